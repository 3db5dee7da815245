"""What every tool-call parser shares: the call and result types, the parser protocol and small
helpers. [no torch]

The contract: `extract(text)` parses a whole output; `stream().feed(delta, final)` takes it as
generated and releases a call only once it is complete, so the streamed content and calls, put
together, equal `extract` of the whole text however it was chunked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

DECODER = json.JSONDecoder()
# What decoding model-written JSON may raise: deep nesting exhausts the decoder's recursion, and
# a malformed call must stay content, never fail the request.
JSON_ERRORS = (ValueError, RecursionError)

# The request's tools as the parsers see them: function name -> its `parameters` JSON schema.
ToolSchemas = Mapping[str, dict[str, Any] | None]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str | None = None  # the id the model wrote (kimi_k2, mistral's [CALL_ID]); None: the server makes one


@dataclass
class Extracted:
    content: str | None = None
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStream(Protocol):
    def feed(self, delta: str, final: bool = False) -> Extracted:
        """The content and the complete calls `delta` releases (content "" or None: nothing)."""
        ...


class ToolParser(Protocol):
    name: str
    # The format's markers are special tokens in its models' tokenizers: the output must be
    # detokenized with them, or the parser has nothing to find.
    keeps_special_tokens: bool

    def extract(self, text: str) -> Extracted: ...

    def stream(self) -> ToolCallStream: ...

    def for_request(self, tools: ToolSchemas) -> ToolParser:
        """This parser for one request's tools (formats whose values are typed by the schemas)."""
        ...

    def new_call_id(self) -> str | None:
        """An id for a call the model wrote none for; None: the server's `chatcmpl-tool-...`."""
        ...


class ParserBase:
    """Defaults for the ToolParser protocol: no special tokens kept, tools not needed, server ids."""

    name = ""
    keeps_special_tokens = False

    def for_request(self, tools: ToolSchemas) -> ToolParser:
        return self  # type: ignore[return-value]

    def new_call_id(self) -> str | None:
        return None


def dumps(args: Any) -> str:
    """Arguments as the answer carries them, whatever the model wrote (one spelling for all parsers)."""
    return json.dumps(args, ensure_ascii=False)


def make_call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded object {"name": str, <one of args_keys>: {...}}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    present = [k for k in args_keys if k in obj]
    if len(present) > 1:
        return None
    args = obj[present[0]] if present else {}
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], dumps(args))


def json_object(text: str) -> dict[str, Any] | None:
    """`text` (surrounding whitespace allowed) as a JSON object, or None."""
    try:
        value = json.loads(text)
    except JSON_ERRORS:
        return None
    return value if isinstance(value, dict) else None


def is_jsonable(value: Any) -> bool:
    """Whether `value` is plain JSON data (NaN and infinities are not: json.dumps would write
    them as bare NaN / Infinity, which no JSON reader takes). Walked without recursion: a
    model's arguments may nest deeper than Python's stack."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                return False
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                return False
            todo.extend(v.values())
        elif not (v is None or isinstance(v, (str, bool, int))):
            return False
    return True


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker` (held back while streaming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i
