"""`glm45` (GLM-4.5, GLM-4.6): the function's name, then key / value element pairs. [no torch]

    Let me check.
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name is the block's first line. A value is the text between `<arg_value>` and
`</arg_value>`, as written; as vLLM reads it, it stays text when the request's tool schema
declares the parameter a string, and otherwise becomes the JSON value it spells (`3`, `true`,
`{"a": 1}`) if it spells one (typed.py). A block that is not exactly this stays in the content
as written (blocks.py).
"""

from __future__ import annotations

from typing import Any

from stoker.server.generate.tools.parsers.base import ToolCall, ToolParser, ToolSchemas, dumps, skip_ws
from stoker.server.generate.tools.parsers.blocks import BlockParser
from stoker.server.generate.tools.parsers.typed import json_or_text, parameter_schema

_KEY, _KEY_END = "<arg_key>", "</arg_key>"
_VALUE, _VALUE_END = "<arg_value>", "</arg_value>"


def _element(body: str, i: int, open_tag: str, close_tag: str) -> tuple[str, int] | None:
    """(the text of `<tag>...</tag>` at i, the index after it), or None."""
    if not body.startswith(open_tag, i):
        return None
    end = body.find(close_tag, i + len(open_tag))
    if end < 0:
        return None
    return body[i + len(open_tag):end], end + len(close_tag)


class Glm45Parser(BlockParser):
    name = "glm45"
    keeps_special_tokens = True  # GLM's tokenizer marks <tool_call> and <arg_key>... special
    open_marker, close_marker = "<tool_call>", "</tool_call>"

    def __init__(self, tools: ToolSchemas | None = None) -> None:
        self.tools: ToolSchemas = tools or {}

    def for_request(self, tools: ToolSchemas) -> ToolParser:
        return Glm45Parser(tools)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        ends = [e for e in (body.find("\n"), body.find(_KEY)) if e >= 0]
        head_end = min(ends) if ends else len(body)
        function = body[:head_end].strip()
        if not function or any(c in function for c in "<> \t"):
            return None
        args: dict[str, Any] = {}
        i = skip_ws(body, head_end)
        while i < len(body):
            key = _element(body, i, _KEY, _KEY_END)
            if key is None or not key[0].strip():
                return None
            value = _element(body, skip_ws(body, key[1]), _VALUE, _VALUE_END)
            if value is None:
                return None
            name = key[0].strip()
            args[name] = json_or_text(value[0], parameter_schema(self.tools, function, name))
            i = skip_ws(body, value[1])
        return [ToolCall(function, dumps(args))]
