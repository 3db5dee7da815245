"""Request bodies of /v1/embeddings (OpenAI's), /v1/rerank (Jina's, Cohere's and vLLM's) and
/v1/score (vLLM's), with protocol_base.py's conventions: strict numbers, unknown fields ignored,
fields that ask for what this server does not do refused with a 400 that names them."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from stoker.server.protocol_base import SmallInt, TokenId, _Body, _Request

# OpenAI's limit on inputs in one embeddings request.
MAX_INPUTS = 2048
Priority = Annotated[int, Strict(), Field(ge=0, le=2**31 - 1)]
# vLLM's: -1 truncates to max_model_len, k >= 1 keeps k tokens.
Truncate = Annotated[int, Strict(), Field(ge=-1, le=2**31 - 1)]


def _refuse(data: Any, fields: dict[str, str]) -> Any:
    if isinstance(data, dict):
        for name, why in fields.items():
            if data.get(name) not in (None, False, [], ""):
                raise PydanticCustomError("unsupported_field", "{name}: {why}", {"name": name, "why": why, "param": name})
    return data


class _PoolingFields(_Request):
    model: str | None = None
    truncate_prompt_tokens: Truncate | None = None
    priority: Priority = 0  # the batcher's level: 1 highest ... --priority-levels; 0 the default level
    user: str | None = None  # OpenAI's end-user id: it never changes the output
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's: names the response

    @model_validator(mode="before")
    @classmethod
    def _refuse_vllm_extras(cls, data: Any) -> Any:
        return _refuse(data, {"additional_data": "additional_data is not read by any model here; omit it",
                              "mm_processor_kwargs": "text-only models: no multimodal processor runs",
                              "normalize": "embeddings are returned as the model's pooler makes them (sentence-"
                                           "transformers' modules decide normalization); omit normalize"})

    def response_id(self, prefix: str) -> str:
        """vLLM's: `{prefix}-{request_id}` when the client named the request, else a random id."""
        return f"{prefix}-{self.request_id}" if self.request_id is not None else f"{prefix}-{uuid.uuid4().hex}"


class EmbeddingRequest(_PoolingFields):
    input: Annotated[str, Field()] | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)] | \
        Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: SmallInt | None = None
    add_special_tokens: StrictBool = True

    @model_validator(mode="before")
    @classmethod
    def _refuse_unhonoured(cls, data: Any) -> Any:
        return _refuse(data, {"messages": "chat-style embeddings are not supported; send the text in input",
                              "embed_dtype": "only float32 embeddings are served (encoding_format float or base64)"})

    def inputs(self) -> list[str] | list[list[int]]:
        """Always a list: of texts, or of token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # type: ignore[list-item]
        return self.input  # type: ignore[return-value]


class RerankDocument(_Body):
    text: str


class RerankRequest(_PoolingFields):
    query: str
    documents: Annotated[list[str | RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: Annotated[int, Strict(), Field(ge=0, le=MAX_INPUTS)] | None = None  # None or 0: all
    return_documents: StrictBool = True  # vLLM always returns them; Jina's default, Cohere's is false

    @model_validator(mode="before")
    @classmethod
    def _refuse_unhonoured(cls, data: Any) -> Any:
        return _refuse(data, {"rank_fields": "documents are texts (or {text} objects); rank_fields is not supported",
                              "max_chunks_per_doc": "long documents are not chunked; send truncate_prompt_tokens"})

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_PoolingFields):
    text_1: str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
    text_2: str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]

    def pairs(self) -> list[tuple[str, str]]:
        """vLLM's pairing: 1 x 1, 1 x N (the one text against each), or N x N (zipped). ValueError otherwise."""
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        right = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(left) == 1:
            return [(left[0], r) for r in right]
        if len(left) != len(right):
            raise ValueError(f"text_1 has {len(left)} texts and text_2 {len(right)}: send one text_1, or as many as text_2")
        return list(zip(left, right))
