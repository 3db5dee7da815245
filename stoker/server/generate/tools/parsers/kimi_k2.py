"""`kimi_k2` (Kimi K2): a section of calls, each with the id the model gives it. [no torch]

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call id `functions.NAME:INDEX` is kept as the OpenAI call id (as vLLM keeps it: Kimi's
template writes it back in the next turn); the function's name is what stands between the last
`.` and the `:` (`get_weather:0`, without the `functions.` prefix, is read too). Several calls
follow one another in the section (whitespace between them is fine). The section is one block
(blocks.py): its calls go out when it closes (or the output ends); a section with anything else
in it stays in the content as written.
"""

from __future__ import annotations

from stoker.server.generate.tools.parsers.base import ToolCall, dumps, json_object
from stoker.server.generate.tools.parsers.blocks import BlockParser, marked_calls

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _call(inside: str) -> ToolCall | None:
    call_id, sep, args_text = inside.partition(ARGUMENT_BEGIN)
    call_id = call_id.strip()
    qualified, colon, index = call_id.rpartition(":")
    name = qualified.rpartition(".")[2]
    if not sep or not colon or not index.isdigit() or not name or any(c.isspace() or c == "<" for c in call_id):
        return None
    args = json_object(args_text)
    return None if args is None else ToolCall(name, dumps(args), id=call_id)


class KimiK2Parser(BlockParser):
    name = "kimi_k2"
    keeps_special_tokens = True
    open_marker, close_marker = SECTION_BEGIN, SECTION_END

    def parse_block(self, body: str) -> list[ToolCall] | None:
        return marked_calls(body, CALL_BEGIN, CALL_END, _call)
