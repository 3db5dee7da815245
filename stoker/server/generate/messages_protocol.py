"""Anthropic's Messages API request, and its translation into a chat-completions request.

`POST /v1/messages` is served statelessly over the chat path (messages.py), as vLLM serves it:
`system` becomes a system message first, user and assistant turns chat messages, `tool_use`
blocks an assistant turn's `tool_calls`, `tool_result` blocks `tool` messages, `tools` function
tools, `tool_choice` any/tool the chat's "required"/named choice.

Unknown fields are refused, as Anthropic's API refuses them (not ignored, as the OpenAI routes
do): a client sending a field this server does not know must not get a 200 that silently left
it out. Known fields the engine cannot honour (extended thinking, images and documents, server
tools, MCP servers, containers, a final assistant turn to continue) are a 400 naming them too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import ConfigDict, Field, Strict, StrictBool, model_validator

from stoker.server.protocol_base import Number, SmallInt, _Request, refuse_unhonoured, unsupported_field

MaxTokens = Annotated[int, Strict(), Field(ge=1, le=2**31 - 1)]


# (field, does this value ask for behaviour, why it is refused)
_UNHONOURED = (
    ("thinking", lambda v: not (v is None or (isinstance(v, dict) and v.get("type") == "disabled")),
     "extended thinking is not supported (this server returns no thinking blocks); omit thinking or send "
     "{\"type\": \"disabled\"}"),
    ("container", lambda v: v is not None, "code execution containers are not available on this server; omit container"),
    ("mcp_servers", lambda v: bool(v), "this server connects to no MCP servers; run the tools on the client and send "
                                       "them as tools"),
    ("context_management", lambda v: v is not None, "context editing is not supported; send the conversation to keep"),
    ("service_tier", lambda v: v not in (None, "auto", "standard_only"),
     "this server has one tier; send 'auto' or 'standard_only', or omit service_tier"),
    ("output_config", lambda v: isinstance(v, dict) and v.get("effort") is not None,
     "effort is not supported (this server runs no reasoning models); omit output_config.effort"),
    ("output_format", lambda v: v is not None, "the top-level output_format is not supported; send "
                                               "output_config.format"),
    ("diagnostics", lambda v: v is not None, "no prompt-cache diagnostics are produced here; omit diagnostics"),
    ("inference_geo", lambda v: v is not None, "this server runs where it is deployed; omit inference_geo"),
    ("speed", lambda v: v not in (None, "standard"), "this server has one speed; send 'standard' or omit speed"),
)


class _MessagesBody(_Request):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    # Anthropic's API refuses fields it does not know; so does this route (see the module docstring).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())

    model: str
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: a JSON schema the output is held to
    # Accepted so their no-op values pass; anything else is refused below.
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    output_format: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: str | None = None
    # Prompt caching is automatic here (the prefix cache): cache_control, top-level or on
    # blocks and tools, is a hint that changes no output, so it is accepted.
    cache_control: dict[str, Any] | None = None
    # Informational: attribution of the request (never changes the output).
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_honoured(cls, data: Any) -> Any:
        return refuse_unhonoured(data, _UNHONOURED)

    def chat_messages(self) -> list[dict[str, Any]]:
        """`system` and the turns as chat messages (ValueError naming the field otherwise)."""
        out = [{"role": "system", "content": system_text(self.system)}] if self.system else []
        return out + chat_messages(self.messages)

    def chat_options(self) -> dict[str, Any]:
        """The chat body's `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`, as far as given."""
        body: dict[str, Any] = {}
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        body.update(chat_tool_choice(self.tool_choice))
        fmt = output_format(self.output_config)
        if fmt is not None:
            body["response_format"] = fmt
        return body


class CountTokensRequest(_MessagesBody):
    """POST /v1/messages/count_tokens: the prompt a Messages request with this body would have."""

    def chat_body(self) -> dict[str, Any]:
        return {"model": self.model, "messages": self.chat_messages(), **self.chat_options()}


class MessagesRequest(_MessagesBody):
    max_tokens: MaxTokens
    stop_sequences: list[str] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: SmallInt | None = None
    stream: StrictBool | None = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None

    @model_validator(mode="after")
    def _metadata_user_id_only(self) -> MessagesRequest:
        unknown = sorted(set(self.metadata or {}) - {"user_id"})
        if unknown:  # Anthropic's metadata has user_id only; it is informational here
            raise unsupported_field("metadata", f"only user_id is accepted; got {unknown}")
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat-completions body this request means (ValueError naming the field otherwise)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "max_tokens": self.max_tokens,
                                "stream": bool(self.stream), **self.chat_options()}
        if self.stream:  # the usage chunk gives message_delta its output_tokens
            body["stream_options"] = {"include_usage": True}
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return body


# ---------------------------------------------------------------------- messages -> chat
_NO_MEDIA = "this server runs text-only models: image and document blocks are not supported"
_REFUSED_BLOCKS = {
    "image": _NO_MEDIA, "document": _NO_MEDIA, "search_result": _NO_MEDIA,
    "thinking": "thinking blocks are not supported (this server runs no extended thinking); leave them out of the "
                "turns sent back",
    "redacted_thinking": "thinking blocks are not supported (this server runs no extended thinking); leave them out "
                         "of the turns sent back",
}


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ValueError(f"{where} must be a content block object with a type")
    return block["type"]


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: a text block needs text, a string")
    return text


def system_text(system: str | list[dict[str, Any]]) -> str:
    """`system`, a string or text blocks (joined by newlines, as chat joins text parts)."""
    if isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        where = f"system[{j}]"
        if _kind(block, where) != "text":
            raise ValueError(f"{where}: system blocks must be text blocks, got {block['type']!r}")
        texts.append(_text(block, where))
    return "\n".join(texts)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_result block -> a chat `tool` message. is_error is written into the text: chat
    templates have no field for it, and the model must still see that the call failed."""
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise ValueError(f"{where}: a tool_result block needs tool_use_id")
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            inner = f"{where}.content[{k}]"
            kind = _kind(part, inner)
            if kind != "text":
                raise ValueError(f"{inner}: {_REFUSED_BLOCKS.get(kind, f'block type {kind!r} is not supported')} "
                                 "(tool results: text only)")
            parts.append(_text(part, inner))
        text = "\n".join(parts)
    else:
        raise ValueError(f"{where}.content must be a string or a list of text blocks")
    is_error = block.get("is_error")
    if is_error not in (None, True, False):
        raise ValueError(f"{where}.is_error must be a boolean")
    return {"role": "tool", "tool_call_id": tool_use_id, "content": f"Error: {text}" if is_error else text}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A past tool_use block -> a chat tool call (arguments as JSON text, as OpenAI sends them)."""
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool_use block needs id and name")
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.input must be an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def chat_messages(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User and assistant turns -> chat messages. A user turn's tool_result blocks become `tool`
    messages ahead of its text (Anthropic puts results first); an assistant turn's tool_use
    blocks its `tool_calls`."""
    out: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        role = turn.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role must be user or assistant, got {role!r} (the system prompt goes in system)")
        content = turn.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = _kind(block, at)
            if kind == "text":
                texts.append(_text(block, at))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and role == "user":
                results.append(_tool_result(block, at))
            elif kind in ("tool_use", "tool_result"):
                raise ValueError(f"{at}: {kind} blocks belong in "
                                 f"{'assistant' if kind == 'tool_use' else 'user'} turns")
            else:
                raise ValueError(f"{at}: {_REFUSED_BLOCKS.get(kind, f'block type {kind!r} is not supported')} "
                                 "(text, tool_use, tool_result)")
        if role == "user":
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "\n".join(texts)})
        else:
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    if turns and turns[-1].get("role") == "assistant":
        # Anthropic continues a final assistant turn ("prefill"); the chat path can only start a
        # new one, which would answer something else: refused rather than answered wrongly.
        raise ValueError(f"messages[{len(turns) - 1}]: a final assistant turn (prefill, continued by the model) is not "
                         "supported; end with a user turn")
    return out


def output_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """output_config.format ({"type": "json_schema", "schema"}) -> chat's response_format (enforced)."""
    unknown = sorted(set(config or {}) - {"format", "effort"})  # effort: refused (or null) already
    if unknown:
        raise ValueError(f"output_config: fields {unknown} are not supported")
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ValueError("output_config.format must be {\"type\": \"json_schema\", \"schema\": <a JSON schema object>}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ---------------------------------------------------------------------- tools -> chat
_TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control", "strict"}


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A client tool ({name, description, input_schema}) -> a chat function tool. Server tools
    (web_search, bash, text_editor, ...) run on Anthropic's platform: refused."""
    where = f"tools[{i}]"
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise ValueError(f"{where}: tool type {kind!r} is not supported here (client tools only, with name and "
                         "input_schema; server tools such as web_search run on Anthropic's platform)")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise ValueError(f"{where}: fields {unknown} are not supported")
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool needs a name")
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: a tool needs input_schema, a JSON schema object")
    fn: dict[str, Any] = {"name": name, "parameters": schema}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    if tool.get("strict") is not None:
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's tool_choice -> chat's tool_choice (and parallel_tool_calls).

    `disable_parallel_tool_use` is honoured where the output is constrained (`any`: at most one
    call in the grammar; `tool`: one call always; `none`: no calls); with `auto` the model's text
    is only parsed, so one call cannot be guaranteed: refused."""
    if choice is None:
        return {}
    kind = choice.get("type")
    single = choice.get("disable_parallel_tool_use")
    if single not in (None, True, False):
        raise ValueError("tool_choice.disable_parallel_tool_use must be a boolean")
    if kind == "auto":
        if single:
            raise ValueError("tool_choice.disable_parallel_tool_use is not enforced with type 'auto' (calls are parsed "
                             "from free text); send type 'any' or 'tool' for one enforced call")
        return {"tool_choice": "auto"}
    if kind == "any":
        return {"tool_choice": "required", **({"parallel_tool_calls": False} if single else {})}
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("tool_choice of type 'tool' needs name")
        return {"tool_choice": {"type": "function", "function": {"name": name}}}
    if kind == "none":
        return {"tool_choice": "none"}
    raise ValueError(f"tool_choice type must be auto, any, tool or none, got {kind!r}")
