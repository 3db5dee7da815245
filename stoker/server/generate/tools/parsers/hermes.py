"""`hermes` (Hermes 2/3, Qwen 2.5/3): calls as JSON objects in `<tool_call>` blocks. [no torch]

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`"parameters"` is taken for `"arguments"`. A block whose body is not such an object stays in
the content, as written; so does an unclosed block that does not parse at the end. The content
is the text around the blocks (blocks.py).
"""

from __future__ import annotations

import json

from stoker.server.generate.tools.parsers.base import JSON_ERRORS, ToolCall, make_call
from stoker.server.generate.tools.parsers.blocks import BlockParser

_ARGS = ("arguments", "parameters")


class HermesParser(BlockParser):
    name = "hermes"
    # Qwen's and Hermes' tokenizers mark <tool_call> special (vLLM keeps them for this parser too)
    keeps_special_tokens = True
    open_marker, close_marker = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        try:
            call = make_call(json.loads(body), _ARGS)
        except JSON_ERRORS:
            return None
        return [call] if call else None
