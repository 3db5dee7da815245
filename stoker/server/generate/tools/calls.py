"""What `tools` / `tool_choice` make of one chat request's output, as vLLM answers it.

* plain (`none`, or no tools): the text is the content.
* named function: the output is constrained to that function's arguments object; it comes
  back as one call, `content` "" (vLLM's), finish_reason as generated ("stop", as OpenAI).
* `required`: the output is constrained to `[{"name", "parameters"}, ...]`; each item is a
  call, `content` "", finish_reason "tool_calls".
* `auto` (with `--enable-auto-tool-choice --tool-call-parser P`): the text is parsed by P;
  with calls found, finish_reason "tool_calls" and `content` what P leaves outside them.

"tool_calls" replaces only "stop": an output cut by max_tokens stays "length".

Streamed, each choice's text goes through a `ChoiceToolStream`, which turns text deltas into
OpenAI delta objects: `{"content": ...}` or `{"tool_calls": [{"index", "id", "type",
"function": {"name", "arguments": ""}}]}` followed by `{"tool_calls": [{"index", "function":
{"arguments": ...}}]}` pieces. Named calls stream their arguments as generated; parsed calls
(auto, required) go out once their JSON is complete, so arguments are never garbled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.server.errors import bad_request
from stoker.server.generate.protocol import ChatCompletionRequest, NamedToolChoice
from stoker.server.generate.serving import new_id
from stoker.server.state import ServerSettings
from stoker.server.generate.tool_lookup import get_tool_parser
from stoker.server.generate.tools.parsers import REQUIRED, ToolCall, ToolParser


def call_id() -> str:
    return new_id("chatcmpl-tool")


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # plain | named | required | auto
    function: str | None = None  # named: the function forced
    parser: ToolParser | None = None  # required, auto

    @classmethod
    def of(cls, req: ChatCompletionRequest, settings: ServerSettings) -> ToolPlan:
        """400 for "auto" with tools on a server started without auto tool choice (vLLM's message)."""
        mode = req.tool_mode
        if mode == "named":
            assert isinstance(req.tool_choice, NamedToolChoice)
            return cls("named", function=req.tool_choice.function.name)
        if mode == "required":
            return cls("required", parser=REQUIRED)
        if mode == "auto" and req.tools:
            if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
                raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                  "set (or send tool_choice 'none', 'required' or a named function)", "tool_choice")
            return cls("auto", parser=get_tool_parser(settings.tool_call_parser))
        return cls("plain")

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        if called and reason == "stop" and self.mode in ("required", "auto"):
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the choice's message, its finish_reason) for the whole output text."""
        if self.mode == "plain":
            return {"role": "assistant", "content": text}, reason
        if self.mode == "named":
            call = {"id": call_id(), "type": "function", "function": {"name": self.function, "arguments": text}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}, reason
        assert self.parser is not None
        found = self.parser.extract(text)
        message: dict[str, Any] = {"role": "assistant", "content": found.content}
        if self.mode == "required" and found.content is None:
            message["content"] = ""
        if found.calls:
            message["tool_calls"] = [_call_json(c) for c in found.calls]
        return message, self.finish_reason(reason, bool(found.calls))

    def stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


class ChoiceToolStream:
    """One choice's text deltas -> OpenAI delta objects (see the module docstring)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parsed = plan.parser.stream() if plan.parser is not None else None
        self.num_calls = 0

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _open(self, name: str) -> dict[str, Any]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return {"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]}

    def step(self, delta: str, final: bool) -> list[dict[str, Any]]:
        if self.plan.mode == "plain":
            return [{"content": delta}] if delta else []
        if self.plan.mode == "named":
            out = []
            if not self.called and (delta or final):
                out.append(self._open(self.plan.function or ""))
            if delta:
                out.append(self._arguments(delta))
            return out
        assert self.parsed is not None
        found = self.parsed.feed(delta, final)
        out = [{"content": found.content}] if found.content else []
        for call in found.calls:
            out += [self._open(call.name), self._arguments(call.arguments)]
        return out
