"""`deepseek_v3` (DeepSeek-V3, R1-0528, V3.1): a section of calls between special tokens. [no torch]

The markers are DeepSeek's own tokens, written with full-width vertical bars (U+FF5C) and
U+2581 where a space would be. DeepSeek-V3 writes the type `function` and fences the arguments:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1 writes the name where the type was, and the bare JSON:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Several calls follow one another inside the section (whitespace between them is fine). The
section is one block (blocks.py): its calls go out when it closes (or the output ends); a
section with anything else in it stays in the content as written.
"""

from __future__ import annotations

from stoker.server.generate.tools.parsers.base import ToolCall, dumps, json_object
from stoker.server.generate.tools.parsers.blocks import BlockParser, marked_calls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _fenced(text: str) -> str | None:
    """The inside of a ```json ... ``` (or ``` ... ```) fence that is all of `text`, or None."""
    text = text.strip()
    if not (text.startswith("```") and text.endswith("```") and len(text) >= 6):
        return None
    inner = text[3:-3]
    return inner[4:] if inner.startswith("json") else inner


def _call(inside: str) -> ToolCall | None:
    head, sep, rest = inside.partition(SEP)
    if not sep:
        return None
    head = head.strip()
    if rest.lstrip().startswith("{"):  # V3.1: NAME<｜tool▁sep｜>{...}
        name, args = head, json_object(rest)
    else:  # V3: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
        name, _, fenced = rest.partition("\n")
        name = name.strip()
        inner = _fenced(fenced)
        args = json_object(inner) if head == "function" and inner is not None else None
    if not name or args is None or any(c.isspace() for c in name):
        return None
    return ToolCall(name, dumps(args))


class DeepSeekV3Parser(BlockParser):
    name = "deepseek_v3"
    keeps_special_tokens = True
    open_marker, close_marker = CALLS_BEGIN, CALLS_END

    def parse_block(self, body: str) -> list[ToolCall] | None:
        return marked_calls(body, CALL_BEGIN, CALL_END, _call)
