"""OpenAI's Responses API request, and its translation into a chat-completions request.

`POST /v1/responses` is served statelessly over the chat path (responses.py): the
input items become chat messages, `instructions` a system message first, `text.format` the
chat `response_format`, function tools the chat tools. What needs a stored conversation
(`store`, `previous_response_id`, `conversation`, item references) or a capability this server
lacks (hosted tools, reasoning, images) is a 400 that names it, never a silent pass.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool, model_validator

from stoker.server.protocol_base import Number, SmallInt, _Request, refuse_unhonoured, unsupported_field

_STATELESS = "this server is stateless (nothing is stored between requests)"


# (field, does this value ask for behaviour, why it is refused)
_UNHONOURED = (
    ("store", lambda v: v is True, f"{_STATELESS}; send store: false or omit it"),
    ("previous_response_id", lambda v: v is not None, f"{_STATELESS}; send the whole conversation in input"),
    ("conversation", lambda v: v is not None, f"{_STATELESS}; send the whole conversation in input"),
    ("background", lambda v: bool(v), "background responses need storage; omit background"),
    ("prompt", lambda v: v is not None, "stored prompt templates are not supported; send input and instructions"),
    ("reasoning", lambda v: isinstance(v, dict) and any(v.get(k) is not None for k in ("summary", "generate_summary")),
     "reasoning summaries are not generated (with --reasoning-parser the reasoning comes back whole, as a reasoning "
     "item); send only reasoning.effort"),
    ("service_tier", lambda v: v not in (None, "auto", "default"), "there is one service tier; send auto or default"),
    ("include", lambda v: bool(v), "no extra output data (logprobs, sources, encrypted reasoning) is produced; omit include"),
    ("truncation", lambda v: v not in (None, "disabled"), "input is never truncated here (too long is a 400); send 'disabled'"),
    ("max_tool_calls", lambda v: v is not None, "max_tool_calls is not enforced; omit it"),
    ("top_logprobs", lambda v: bool(v), "output logprobs are not returned by /v1/responses yet; use /v1/chat/completions"),
)


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: SmallInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool | None = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    parallel_tool_calls: StrictBool | None = True  # advisory, as in OpenAI's API
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    store: StrictBool | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: the chat template's reasoning_effort
    service_tier: str | None = None  # auto / default only (one tier)

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_honoured(cls, data: Any) -> Any:
        return refuse_unhonoured(data, _UNHONOURED)

    # ------------------------------------------------------------------ -> chat
    def chat_body(self) -> dict[str, Any]:
        """The chat-completions body this request means (ValueError naming the field otherwise)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += input_messages(self.input)
        if not messages:
            raise ValueError("input: give at least one message")
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name, value in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature), ("top_p", self.top_p)):
            if value is not None:
                body[name] = value
        fmt = response_format(self.text)
        if fmt is not None:
            body["response_format"] = fmt
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        choice = chat_tool_choice(self.tool_choice)
        if choice is not None and (self.tools or choice == "none"):
            body["tool_choice"] = choice
        if self.tools and self.parallel_tool_calls is False:
            body["parallel_tool_calls"] = False  # chat's rule: at most one call
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            body["reasoning_effort"] = effort
        return body

    def echo_fields(self) -> dict[str, Any]:
        """What a Response object repeats of its request."""
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens, "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls if self.parallel_tool_calls is not None else True,
            "temperature": self.temperature, "top_p": self.top_p, "tools": self.tools or [],
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "text": self.text or {"format": {"type": "text"}}, "store": False, "truncation": "disabled",
            "previous_response_id": None, "reasoning": self.reasoning, "user": self.user, "background": False,
            "service_tier": self.service_tier or "auto",
        }


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or input_text/output_text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"{where}.content[{j}]: part type {kind!r} is not supported (text only: input_text, "
                             "output_text)")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items -> chat messages. Consecutive function calls become one assistant turn with
    several tool_calls (how chat templates expect parallel calls)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
            # Chat templates know no "developer" role: OpenAI's own chat API maps it to system.
            out.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not call["id"] or not call["function"]["name"]:
                raise ValueError(f"{where}: a function_call item needs call_id and name")
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not item.get("call_id"):
                raise ValueError(f"{where}: a function_call_output item needs call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "item_reference":
            raise ValueError(f"{where}: item references need stored items; {_STATELESS}")
        else:
            raise ValueError(f"{where}: item type {kind!r} is not supported (message, function_call, "
                             "function_call_output)")
    return out


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> chat response_format."""
    verbosity = (text or {}).get("verbosity")
    if verbosity not in (None, "medium"):  # the model's own length is all this server has
        raise ValueError(f"text.verbosity {verbosity!r} is not enforced here; omit it or send 'medium' "
                         "(bound the length with max_output_tokens)")
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ValueError("text.format of type json_schema needs schema, a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise ValueError(f"text.format type must be text, json_object or json_schema, got {kind!r}")


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) -> the chat shape (nested under "function")."""
    if tool.get("type") != "function":
        raise ValueError(f"tools[{i}]: tool type {tool.get('type')!r} is not supported here (function tools only; "
                         "hosted tools such as web_search need OpenAI's platform)")
    if not tool.get("name"):
        raise ValueError(f"tools[{i}]: a function tool needs a name")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice {choice!r} is not supported (none, auto, required, or "
                     "{'type': 'function', 'name': ...})")
