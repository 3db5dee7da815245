"""`qwen3_coder` (Qwen3-Coder, Qwen3.5): calls as XML-like blocks, one element per parameter. [no torch]

    I'll look it up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between `<parameter=NAME>` and `</parameter>`, less one newline
on each side (the template writes them); it is typed by the request's tool schema (typed.py:
`days` above is 3 if the schema says integer, "3" if it says string or nothing). A block holds
one or more `<function=...>` elements; a block that is not exactly that stays in the content as
written (blocks.py).
"""

from __future__ import annotations

from typing import Any

from stoker.server.generate.tools.parsers.base import ToolCall, ToolParser, ToolSchemas, dumps, skip_ws
from stoker.server.generate.tools.parsers.blocks import BlockParser
from stoker.server.generate.tools.parsers.typed import parameter_schema, typed_value

_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"


def _name_at(body: str, i: int, prefix: str) -> tuple[str, int] | None:
    """(the NAME of `<prefix NAME>` at i, the index after `>`), or None."""
    if not body.startswith(prefix, i):
        return None
    close = body.find(">", i + len(prefix))
    if close < 0:
        return None
    name = body[i + len(prefix):close].strip()
    if not name or any(c in name for c in "<\n"):
        return None
    return name, close + 1


def _trim_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderParser(BlockParser):
    name = "qwen3_coder"
    keeps_special_tokens = True  # <tool_call> is a special token in Qwen's tokenizers
    open_marker, close_marker = "<tool_call>", "</tool_call>"

    def __init__(self, tools: ToolSchemas | None = None) -> None:
        self.tools: ToolSchemas = tools or {}

    def for_request(self, tools: ToolSchemas) -> ToolParser:
        return Qwen3CoderParser(tools)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        i = skip_ws(body, 0)
        while i < len(body):
            got = self._function(body, i)
            if got is None:
                return None
            call, i = got
            calls.append(call)
            i = skip_ws(body, i)
        return calls or None

    def _function(self, body: str, i: int) -> tuple[ToolCall, int] | None:
        head = _name_at(body, i, _FUNCTION)
        if head is None:
            return None
        function, i = head
        args: dict[str, Any] = {}
        while True:
            i = skip_ws(body, i)
            if body.startswith(_FUNCTION_END, i):
                return ToolCall(function, dumps(args)), i + len(_FUNCTION_END)
            param = _name_at(body, i, _PARAMETER)
            if param is None:
                return None
            name, i = param
            end = body.find(_PARAMETER_END, i)
            if end < 0:
                return None
            args[name] = typed_value(_trim_newlines(body[i:end]), parameter_schema(self.tools, function, name))
            i = end + len(_PARAMETER_END)
