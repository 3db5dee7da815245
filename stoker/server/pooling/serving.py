"""POST /v1/embeddings, /v1/rerank and /v1/score over the pooling models (vLLM's behaviour).

Texts are tokenized on the model's tokenizer thread; each input then goes to the model's
dynamic batcher as one item, and the request awaits all of its items. Limits as vLLM's:
an input longer than the model's max_model_len is a 400 unless `truncate_prompt_tokens`
asks for truncation; `dimensions` only on a Matryoshka model (config.json `is_matryoshka` or
`matryoshka_dimensions`), truncated then renormalized. Scoring with an embedding model is
the cosine similarity of the two embeddings, as vLLM scores with one.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from stoker.pooling.batcher import QueueFullError, QueueTimeoutError
from stoker.server.errors import ApiError, bad_request
from stoker.server.pooling.models import PoolingModel
from stoker.server.pooling.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from stoker.server.state import ServerState

_API = {"embed": "Embeddings API", "score": "Score API", "rerank": "Rerank API"}


def _too_long(limit: int, count: int, index: int) -> ApiError:
    return bad_request(f"This model's maximum context length is {limit} tokens. However, input {index} has {count} "
                       "tokens. Please reduce the length of the input, or send truncate_prompt_tokens to truncate it.",
                       "input")


class OpenAIServingPooling:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def model(self, name: str | None, api: str) -> PoolingModel:
        registry = self.state.pooling
        if registry is None:  # vLLM: a generative model answers the pooling APIs with a 400
            raise bad_request(f"The model does not support {_API[api]}", "model")
        st = self.state
        if (name is not None and name not in registry.names and st.serves_generation
                and (name in st.settings.served_model_names or st.lora_name(name) is not None)):
            # a server holding both: `model` names the generative model (or one of its adapters)
            raise bad_request(f"The model `{name}` does not support {_API[api]}: it is a generative model", "model")
        model = registry.get(name, self.state.settings.retry_after_s)
        if api == "embed" and model.config.kind != "embed":
            raise bad_request(f"The model `{model.names[0]}` is a reranker (cross-encoder): it does not support "
                              f"{_API[api]}; use /v1/rerank or /v1/score", "model")
        return model

    def _truncation(self, model: PoolingModel, truncate: int | None) -> int | None:
        limit = model.config.max_model_len
        if truncate is None:
            return None
        if truncate == -1:
            return limit
        if truncate == 0 or truncate > limit:
            raise bad_request(f"truncate_prompt_tokens ({truncate}) must be -1 or in [1, max_model_len {limit}]",
                              "truncate_prompt_tokens")
        return truncate

    # ------------------------------------------------------------------ tokenization (tokenizer thread)
    @staticmethod
    def _encode_texts(tok: Any, texts: list[str], add_special: bool, truncate: int | None) -> list[list[int]]:
        kw: dict[str, Any] = {"truncation": True, "max_length": truncate} if truncate else {}
        return tok(texts, add_special_tokens=add_special, **kw)["input_ids"]

    async def _token_ids(self, model: PoolingModel, texts: list[str], add_special: bool,
                         truncate: int | None) -> list[list[int]]:
        """A short request without truncation on the event loop (PoolingModel.encode_inline), the
        rest on the tokenizer thread."""
        ids = model.encode_inline(texts, add_special) if truncate is None else None
        if ids is None:
            ids = await model.tokenize(self._encode_texts, texts, add_special, truncate)
        return ids

    @staticmethod
    def _encode_pairs(tok: Any, pairs: list[tuple[str, str]], truncate: int | None) -> tuple[list[list[int]], list[list[int]]]:
        kw: dict[str, Any] = {"truncation": True, "max_length": truncate} if truncate else {}
        enc = tok([p[0] for p in pairs], [p[1] for p in pairs], return_token_type_ids=True, **kw)
        return enc["input_ids"], enc["token_type_ids"]

    def _check_lengths(self, model: PoolingModel, ids: list[list[int]]) -> None:
        for i, seq in enumerate(ids):
            if not seq:
                raise bad_request(f"input {i} has no tokens", "input")
            if len(seq) > model.config.max_model_len:
                raise _too_long(model.config.max_model_len, len(seq), i)

    # ------------------------------------------------------------------ the batcher
    async def _run(self, model: PoolingModel, inputs: list[Any], lengths: list[int], priority: int) -> list[Any]:
        assert model.batcher is not None
        count = model.metrics.on_request if model.metrics is not None else (lambda name, outcome: None)
        try:
            futures = model.batcher.submit_many(inputs, lengths, priority)
        except ValueError as exc:
            count(model.names[0], "refused")
            raise bad_request(str(exc), "priority") from None
        except QueueFullError as exc:
            count(model.names[0], "queue_full")
            raise ApiError(503, f"the server is busy ({exc}); retry later",
                           headers={"Retry-After": str(self.state.settings.retry_after_s)}) from None
        try:
            out = list(await asyncio.gather(*futures))
        except QueueTimeoutError as exc:
            count(model.names[0], "timeout")
            raise ApiError(503, f"the request timed out in the queue ({exc}); retry later",
                           headers={"Retry-After": str(self.state.settings.retry_after_s)}) from None
        finally:
            for f in futures:  # a client gone: its items are dropped when a batch is formed
                f.cancel()
        count(model.names[0], "ok")
        return out

    async def _embed(self, model: PoolingModel, ids: list[list[int]], priority: int) -> list[np.ndarray]:
        from stoker.pooling.runner import PoolInput

        return await self._run(model, [PoolInput(x) for x in ids], [len(x) for x in ids], priority)

    # ------------------------------------------------------------------ endpoints
    async def embeddings(self, req: EmbeddingRequest) -> JSONResponse:
        model = self.model(req.model, "embed")
        truncate = self._truncation(model, req.truncate_prompt_tokens)
        dims = self._dimensions(model, req.dimensions)
        inputs = req.inputs()
        if isinstance(inputs[0], str):
            ids = await self._token_ids(model, inputs, req.add_special_tokens, truncate)
        else:
            ids = [list(x) for x in inputs]  # type: ignore[arg-type]
            bad = [t for x in ids for t in x if not 0 <= t < model.vocab_size][:5]
            if bad:
                raise bad_request(f"input: token ids must be in [0, {model.vocab_size}); got {bad}", "input")
            if truncate:
                ids = [x[-truncate:] for x in ids]  # vLLM keeps the last tokens of a token-id input
        self._check_lengths(model, ids)
        vectors = await self._embed(model, ids, req.priority)
        data = []
        for i, vec in enumerate(vectors):
            if dims is not None:
                vec = vec[:dims]
                if model.config.normalize:
                    vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
            value: Any = (base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode() if req.encoding_format == "base64"
                          else vec.tolist())
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(x) for x in ids)
        return JSONResponse({"id": req.response_id("embd"), "object": "list", "created": int(time.time()),
                             "model": req.model or model.names[0], "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _dimensions(self, model: PoolingModel, dims: int | None) -> int | None:
        if dims is None:
            return None
        cfg = model.config
        if not cfg.is_matryoshka:
            raise bad_request(f"Model \"{model.names[0]}\" does not support matryoshka representation, changing output "
                              "dimensions will lead to poor results.", "dimensions")
        if cfg.matryoshka_dimensions and dims not in cfg.matryoshka_dimensions:
            raise bad_request(f"Model \"{model.names[0]}\" only supports {list(cfg.matryoshka_dimensions)} for matryoshka "
                              f"representation, got {dims}", "dimensions")
        if not 1 <= dims <= cfg.hidden_size:
            raise bad_request(f"dimensions must be in [1, {cfg.hidden_size}], got {dims}", "dimensions")
        return dims

    async def _scores(self, model: PoolingModel, pairs: list[tuple[str, str]], truncate: int | None,
                      priority: int) -> tuple[list[float], int]:
        """A relevance score per (query, document) pair, and the tokens computed."""
        if model.config.kind == "classify":
            from stoker.pooling.runner import PoolInput

            ids, types = await model.tokenize(self._encode_pairs, pairs, truncate)
            self._check_lengths(model, ids)
            scores = await self._run(model, [PoolInput(i, t) for i, t in zip(ids, types)], [len(i) for i in ids], priority)
            return [float(s) for s in scores], sum(len(i) for i in ids)
        texts = list(dict.fromkeys(t for p in pairs for t in p))  # each distinct text embedded once
        ids = await self._token_ids(model, texts, True, truncate)
        self._check_lengths(model, ids)
        vectors = dict(zip(texts, await self._embed(model, ids, priority)))

        def cosine(a: np.ndarray, b: np.ndarray) -> float:
            return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))

        return [cosine(vectors[q], vectors[d]) for q, d in pairs], sum(len(i) for i in ids)

    async def rerank(self, req: RerankRequest) -> JSONResponse:
        model = self.model(req.model, "rerank")
        docs = req.document_texts()
        scores, tokens = await self._scores(model, [(req.query, d) for d in docs],
                                            self._truncation(model, req.truncate_prompt_tokens), req.priority)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            row: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                row["document"] = {"text": docs[i]}
            results.append(row)
        return JSONResponse({"id": req.response_id("rerank"), "model": req.model or model.names[0],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})

    async def score(self, req: ScoreRequest) -> JSONResponse:
        model = self.model(req.model, "score")
        try:
            pairs = req.pairs()
        except ValueError as exc:
            raise bad_request(str(exc), "text_1") from None
        scores, tokens = await self._scores(model, pairs, self._truncation(model, req.truncate_prompt_tokens), req.priority)
        return JSONResponse({"id": req.response_id("score"), "object": "list", "created": int(time.time()),
                             "model": req.model or model.names[0],
                             "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})
