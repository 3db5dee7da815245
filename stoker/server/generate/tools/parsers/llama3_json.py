"""`llama3_json` (Llama 3.x JSON tool calling): the reply is calls as JSON objects. [no torch]

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The reply starts (after optional whitespace and `<|python_tag|>`) with `{"name": ...,
"parameters": {...}}` (or `"arguments"`), several separated by `;`. Parsing stops at the first
thing that is not such an object: what follows is the content (None if nothing). A reply that
does not start with `{` is plain content, exactly.
"""

from __future__ import annotations

from stoker.server.generate.tools.parsers.base import (DECODER, JSON_ERRORS, Extracted, ParserBase, ToolCall, ToolCallStream,
                                                     make_call)

_PYTHON_TAG = "<|python_tag|>"
_LLAMA_ARGS = ("parameters", "arguments")
_SEPARATORS = " \t\r\n;"


def _llama_start(text: str) -> int | None:
    """Index of the first `{` when the reply opens as a JSON call, -1 when it cannot, None when
    it cannot be told yet (only whitespace or the start of <|python_tag|> so far)."""
    i = len(text) - len(text.lstrip())
    rest = text[i:]
    if not rest or (_PYTHON_TAG.startswith(rest) and rest != _PYTHON_TAG):
        return None
    if rest.startswith(_PYTHON_TAG):
        i += len(_PYTHON_TAG)
        after = text[i:].lstrip()
        if not after:
            return None
        i = len(text) - len(after)
    return i if text[i] == "{" else -1


def skip_separators(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SEPARATORS:
        i += 1
    return i


def json_call_at(text: str, i: int) -> tuple[ToolCall | None, int] | None:
    """(call or None if the object is not a call, end) for a complete object at i; None if none ends there."""
    try:
        obj, end = DECODER.raw_decode(text, i)
    except JSON_ERRORS:
        return None
    try:
        return make_call(obj, _LLAMA_ARGS), end
    except RecursionError:  # decoded, but too deep to write back: not a call
        return None, end


class Llama3JsonParser(ParserBase):
    name = "llama3_json"

    def extract(self, text: str) -> Extracted:
        i = _llama_start(text)
        if i is None or i < 0:
            return Extracted(text, [])
        calls: list[ToolCall] = []
        while i < len(text) and text[i] == "{":
            got = json_call_at(text, i)
            if got is None or got[0] is None:
                break
            calls.append(got[0])
            i = skip_separators(text, got[1])
        if not calls:
            return Extracted(text, [])
        return Extracted(text[i:] or None, calls)

    def stream(self) -> ToolCallStream:
        return _Llama3Stream()


class _Llama3Stream:
    """Undecided until the first non-space character; then either plain content (sent as it
    comes) or calls, each sent once its object closes; the first thing after the calls that is
    not a call turns the rest into content."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # calls: where the next object (or separators) starts; content: text[:pos] is sent
        self.mode = "start"  # start | calls | content
        self.called = False

    def _to_content(self, start: int) -> None:
        self.mode, self.pos = "content", start if self.called else 0

    def feed(self, delta: str, final: bool = False) -> Extracted:
        self.text += delta
        text, calls = self.text, []
        if self.mode == "start":
            first = _llama_start(text)
            if first is None and not final:
                return Extracted("", [])
            if first is None or first < 0:
                self._to_content(0)
            else:
                self.mode, self.pos = "calls", first
        while self.mode == "calls":
            i = skip_separators(text, self.pos)
            if i == len(text):
                if final:
                    self._to_content(i)
                break
            if text[i] != "{":
                self._to_content(i)
                break
            got = json_call_at(text, i) if "}" in text[i:] else None
            if got is None:
                if final:
                    self._to_content(i)
                break
            call, end = got
            if call is None:
                self._to_content(i)
                break
            calls.append(call)
            self.called = True
            self.pos = end
        content = ""
        if self.mode == "content":
            content, self.pos = text[self.pos:], len(text)
        return Extracted(content, calls)
