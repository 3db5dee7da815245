"""Request bodies of the OpenAI-compatible API, as vLLM accepts them (pydantic v2).

Pydantic checks types and the bounds that protect the process (64-bit seeds, a cap on n);
`SamplingParams` checks the value ranges, so the API and the offline `LLM` agree on them.
Unknown fields are accepted and ignored, as vLLM and OpenAI do. NaN and infinity are
refused: they pass every `<`/`>` range check and would poison the sampler.
"""

from __future__ import annotations

import json

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

from stoker.sampling_params import SamplingParams
from stoker.server.generate import fields as request_fields
from stoker.server.generate.tools import schema as tool_schema
from stoker.server.protocol_base import Number, SmallInt, TokenId, _Body, _Request
from stoker.structured.spec import StructuredOutputs

# OpenAI's own cap on n; also bounds the sequences one request can create.
MAX_N = 128
# A seed of completion i is seed + i: keep it inside torch.Generator's uint64 range.
# Strict: a JSON number, never a boolean or a numeric string (pydantic's lax mode would read
# false as 0 and "3" as 3; OpenAI refuses both, and so does the schema /openapi.json publishes).
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**63 - 1 - MAX_N)]


class StreamOptions(_Body):
    # None: as continuous_usage_stats (vLLM's default is true, OpenAI's false: asking for usage
    # in every chunk alone gets it, as from vLLM, without changing what {} means)
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool = False

    @property
    def wants_usage(self) -> bool:
        return self.include_usage if self.include_usage is not None else self.continuous_usage_stats


class _SamplingFields(_Request):
    """The fields completions and chat share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: SmallInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = 0.0
    frequency_penalty: Number | None = 0.0
    repetition_penalty: Number | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    min_tokens: SmallInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> [-100, 100]
    prompt_logprobs: SmallInt | None = None  # vLLM's extra: each prompt token's logprob and top n
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extra parameters (fields.py says what each does here)
    truncate_prompt_tokens: Annotated[int, Strict(), Field(ge=-1, le=2**31 - 1)] | None = None
    priority: SmallInt = 0
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: disaggregated prefill/decode legs

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_honoured(cls, data: Any) -> Any:
        """A field the engine cannot honour is a 400 that names it, never a silent 200."""
        if isinstance(data, dict):
            for name, why in _unhonoured(data, cls is ChatCompletionRequest):
                raise PydanticCustomError("unsupported_field", "{name}: {why}", {"name": name, "why": why, "param": name})
        return data

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """truncate_prompt_tokens: the last k prompt tokens (-1: the last max_model_len), as vLLM."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = max_model_len if k == -1 else k
        if k == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return ids[-k:]

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field and its valid range."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_token_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured_spec(),
            prompt_logprobs=self.prompt_logprobs,
            kv_transfer_params=self.kv_transfer_params,
        )

    def structured_spec(self) -> StructuredOutputs | None:
        """The one constraint the request asks for (ValueError naming the field otherwise)."""
        asked: list[tuple[str, StructuredOutputs]] = []

        def spec(field: str, **kw: Any) -> None:
            try:
                asked.append((field, StructuredOutputs(**kw)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{field} {exc}") from None

        rf = self.response_format or {}
        kind = rf.get("type", "text")
        if kind == "json_object":
            spec("response_format", json_object=True)
        elif kind == "json_schema":
            body = rf.get("json_schema")
            if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
                raise ValueError("response_format must carry json_schema.schema, a JSON schema object")
            spec("response_format", json=_json_text(body["schema"]))
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
        so = self.structured_outputs or {}
        unknown = set(so) - {"json", "json_object", "regex", "choice", "grammar"}
        if unknown:
            raise ValueError(f"structured_outputs has fields this server does not enforce: {sorted(unknown)}")
        if so:
            spec("structured_outputs", json=_json_text(so["json"]) if so.get("json") is not None else None,
                 json_object=bool(so.get("json_object")), regex=so.get("regex"),
                 choice=tuple(so["choice"]) if so.get("choice") is not None else None, grammar=so.get("grammar"))
        for field, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, field)
            if value is not None:
                value = _json_text(value) if kw == "json" else tuple(value) if kw == "choice" else value
                spec(field, **{kw: value})
        if len(asked) > 1:
            raise ValueError(f"{asked[1][0]} asks for a second output constraint beside {asked[0][0]}; send one")
        return asked[0][1] if asked else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.wants_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def logprob_token(self, token_id: int, text: str) -> str:
        """How a logprob entry names its token: return_tokens_as_token_ids writes 'token_id:{id}'
        (vLLM's form, for tokens whose text is not valid UTF-8 on its own)."""
        return f"token_id:{token_id}" if self.return_tokens_as_token_ids else text


def _json_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise ValueError(f"logit_bias must map token ids (as strings of integers) to values, got keys {list(bias)[:5]}") from None


def _unhonoured(data: dict[str, Any], is_chat: bool) -> list[tuple[str, str]]:
    out = request_fields.refusals(data, "chat" if is_chat else "completions")
    if is_chat:
        messages = data.get("messages")
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            if isinstance(m, dict) and m.get("role") == "function":
                out.append((f"messages[{i}]", "role 'function' (deprecated function calling) is not supported; "
                                              "send role 'tool' with tool_call_id"))
    return out


PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: SmallInt | None = 16  # OpenAI's completions default
    logprobs: SmallInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: SmallInt | None = None
    user: str | None = None
    add_special_tokens: StrictBool = True  # BOS and the like, added to text prompts


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    """Any non-text content part (images, audio): refused with a clear message."""

    type: str


class CalledFunction(_Body):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI sends JSON text; some clients an object


class MessageToolCall(_Body):
    """One call in an assistant turn: {"id", "type": "function", "function": {"name", "arguments"}}."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": the call this is the result of


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # the schema is always enforced where tool_choice forces a call


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ToolChoiceError(ValueError):
    """A tools / tool_choice combination that cannot be served; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# What the chat template call sets itself (HF apply_chat_template's arguments and the variables it
# gives the template): a chat_template_kwargs entry of one of these names would clash or override.
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens",
})


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: SmallInt | None = None  # None: up to the context limit, as vLLM
    max_completion_tokens: SmallInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: SmallInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # the last message left open for the model to continue
    echo: StrictBool = False  # with continue_final_message: the reply starts with that message's content
    add_special_tokens: StrictBool = False  # on top of what the template writes (vLLM's default: none)
    documents: list[dict[str, Any]] | None = None  # for RAG templates, as transformers passes them
    chat_template: str | None = None  # a request's own template (--trust-request-chat-template)
    user: str | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: "required" constrained to one call, "auto" keeps the first
    # vLLM's: with --reasoning-parser, false drops the reasoning from the answer
    include_reasoning: StrictBool = True
    # vLLM's: more variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: the template reads it as `reasoning_effort` (gpt-oss's does; others ignore it), as vLLM passes it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_names(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(set(value or ()) & RESERVED_TEMPLATE_NAMES)
        if clash:
            raise ValueError(f"{clash} are set by the server itself (from messages, tools, add_generation_prompt and "
                             "the tokenizer), not through chat_template_kwargs")
        return value

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: reasoning_effort, then chat_template_kwargs (which win)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape). vLLM renders them also
        with tool_choice "none": the model still knows the tools the conversation used."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_constraint(self) -> StructuredOutputs | None:
        """The output constraint "required" or a named function asks for (ToolChoiceError otherwise)."""
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return None
        shown = "'required'" if mode == "required" else "a named function"
        if not self.tools:
            raise ToolChoiceError(f"tool_choice {shown} needs tools: send the functions the model may call", "tool_choice")
        if mode == "named":
            name = self.tool_choice.function.name  # type: ignore[union-attr]
            picked = [(i, t) for i, t in enumerate(self.tools) if t.function.name == name]
            if not picked:
                raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools "
                                      f"({', '.join(t.function.name for t in self.tools)})", "tool_choice")
        else:
            picked = list(enumerate(self.tools))
        for i, tool in picked:  # each schema checked alone, so the 400 names the tool at fault
            try:
                StructuredOutputs.from_schema(tool_schema.parameters_schema(tool.function.parameters))
            except ValueError as exc:
                raise ToolChoiceError(f"tools[{i}].function.parameters ({tool.function.name}): {exc}", "tools") from None
        if mode == "named":
            return StructuredOutputs.from_schema(tool_schema.parameters_schema(picked[0][1].function.parameters))
        try:
            schema = tool_schema.required_schema([(t.function.name, t.function.parameters) for t in self.tools],
                                                 at_most_one=self.parallel_tool_calls is False)
        except ValueError as exc:
            raise ToolChoiceError(str(exc), "tools") from None
        return StructuredOutputs.from_schema(schema)

    def structured_spec(self) -> StructuredOutputs | None:
        asked = super().structured_spec()
        tool = self.tool_constraint()
        if tool is not None and asked is not None:
            raise ToolChoiceError(f"tool_choice {self.tool_mode!r} constrains the output to tool calls; it cannot be "
                                  "combined with response_format, structured_outputs or guided_*: send one", "tool_choice")
        return tool or asked


class LoadLoRAAdapterRequest(_Request):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(_Request):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: SmallInt | None = None  # vLLM's; the name identifies the adapter here


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them (text parts joined). Raises ValueError
    for content the text-only engine cannot take."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, TextPart):
                    raise ValueError(f"messages[{i}].content: part type {part.type!r} is not supported (text only)")
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _template_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    """A past call as chat templates read it: HF templates take `arguments` as an object (they
    write it with `tojson`), while OpenAI clients send JSON text, so it is parsed (as vLLM does)."""
    args = call.function.arguments
    if isinstance(args, str) and args.strip():
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {exc}") from None
    elif not args:
        args = {}
    out: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out
