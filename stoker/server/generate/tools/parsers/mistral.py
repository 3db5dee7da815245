"""`mistral` (Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small 3.x, Devstral, Magistral): calls after
`[TOOL_CALLS]`. [no torch]

Older tokenizers (before v11) write one JSON array of calls:

    Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

Newer ones write the name, then `[ARGS]` and the arguments object, once per call; v13 adds the
call's id in between:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}

(`[ARGS]` may be missing: the name then runs up to the `{`, as vLLM reads it.) Each
`[TOOL_CALLS]` opens a block that ends where its JSON does (blocks.py): text after it is content,
as is the text before the first; a block whose JSON does not read (or does not close before the
next `[TOOL_CALLS]` or the end) stays in the content as written.

Calls the model gave no id get nine letters and digits, as vLLM gives them: Mistral's chat
templates refuse any other id when the call comes back in the next turn.
"""

from __future__ import annotations

import random
import re
import string

from stoker.server.generate.tools.parsers.base import DECODER, JSON_ERRORS, ToolCall, dumps, make_call, skip_ws
from stoker.server.generate.tools.parsers.blocks import BlockParser

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9]+")
_ID_CHARS = string.ascii_letters + string.digits


def _header(text: str) -> tuple[str | None, str | None, int] | None:
    """(name, call id, where the JSON starts) of a block's text: name None for the array form;
    None when it is neither form."""
    i = skip_ws(text, 0)
    if text.startswith("[", i):
        return None, None, i
    name = _NAME.match(text, i)
    if name is None:
        return None
    i, call_id = name.end(), None
    if text.startswith(CALL_ID, i):
        got = _ID.match(text, i + len(CALL_ID))
        if got is None:
            return None
        i, call_id = got.end(), got.group()
    if text.startswith(ARGS, i):
        i += len(ARGS)
    return name.group(), call_id, skip_ws(text, i)


def _decoded(text: str) -> tuple[str | None, str | None, object, int] | None:
    """(name, call id, the JSON value, where it ends) for a block's text, or None."""
    head = _header(text)
    if head is None or head[2] >= len(text) or text[head[2]] not in "{[":
        return None  # objects and arrays only: they end unambiguously while streaming
    try:
        value, end = DECODER.raw_decode(text, head[2])
    except JSON_ERRORS:
        return None
    return head[0], head[1], value, end


class MistralParser(BlockParser):
    name = "mistral"
    # [TOOL_CALLS] is a control token: HF tokenizers drop it unless special tokens are kept (vLLM's too)
    keeps_special_tokens = True
    open_marker = TOOL_CALLS

    def block_end(self, text: str, body: int, seen: int, final: bool) -> tuple[int, int] | None:
        nxt = text.find(TOOL_CALLS, max(body, seen - len(TOOL_CALLS) + 1))
        limit = nxt if nxt >= 0 else len(text)
        got = _decoded(text[body:limit])  # never across the next [TOOL_CALLS]: whole and streamed agree
        if got is not None:
            return body + got[3], body + got[3]
        if nxt >= 0 or final:
            return limit, limit
        return None

    def parse_block(self, body: str) -> list[ToolCall] | None:
        got = _decoded(body)
        if got is None or got[3] != len(body):
            return None
        name, call_id, value, _ = got
        if name is not None:
            return [ToolCall(name, dumps(value), id=call_id)] if isinstance(value, dict) else None
        if not isinstance(value, list):
            return None
        calls = []
        for item in value:
            call = make_call(item, ("arguments",))
            if call is None:
                return None
            given = item.get("id")
            calls.append(ToolCall(call.name, call.arguments, id=given if isinstance(given, str) and given else None))
        return calls or None

    def new_call_id(self) -> str | None:
        return "".join(random.choices(_ID_CHARS, k=9))
