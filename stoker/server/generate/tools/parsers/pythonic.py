"""`pythonic` (Llama 3.2, Llama 4, ToolACE): the reply is a Python list of calls. [no torch]

    [get_weather(city="Paris", days=3), get_time(zone="UTC")]
    <|python_start|>[get_weather(city='Paris', metric=True, hours=[9, 12], where={"lat": 48.9})]<|python_end|>

The reply starts (after whitespace and an optional `<|python_start|>`, Llama 4's wrapper) with
`[`; the list must hold only calls `name(keyword=literal, ...)`. Arguments are Python literals
(strings, numbers, True / False, None, lists, tuples, dicts) read by `ast.literal_eval` on the
parsed tree, never evaluated as code, and re-serialized as JSON. Whatever follows the list
(after whitespace and an optional `<|python_end|>`) is the content (None if nothing). A reply
that does not start with such a list (text first, `[1, 2]`, a call with a positional or
computed argument, an unclosed list) is plain content, exactly.

Streamed, the calls go out together once the list closes.
"""

from __future__ import annotations

import ast
from typing import Any

from stoker.server.generate.tools.parsers.base import (Extracted, ParserBase, ToolCall, ToolCallStream, dumps, is_jsonable,
                                                     skip_ws)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_OPENERS, _CLOSERS = "([{", ")]}"


def _lead(text: str) -> int | None:
    """Index of the `[` the reply opens with, -1 when it opens otherwise, None when it cannot be
    told yet (only whitespace or the start of <|python_start|> so far)."""
    i = skip_ws(text, 0)
    rest = text[i:]
    if not rest or (PYTHON_START.startswith(rest) and rest != PYTHON_START):
        return None
    if rest.startswith(PYTHON_START):
        i = skip_ws(text, i + len(PYTHON_START))
        if i == len(text):
            return None
    return i if text[i] == "[" else -1


class _ListEnd:
    """Finds the `]` closing the list opened at `start`, as text arrives: brackets are counted
    outside string literals (quotes, triple quotes, backslash escapes)."""

    def __init__(self, start: int) -> None:
        self.pos = start  # text[:pos] is scanned
        self.stack: list[str] = []
        self.quote: str | None = None

    def advance(self, text: str) -> int | None:
        """The closing `]`'s index; -1 if the brackets do not match; None if not closed yet."""
        i = self.pos
        while i < len(text):
            c = text[i]
            if self.quote is not None:
                if c == "\\":
                    if i + 1 == len(text):
                        break  # the escaped character is still to come
                    i += 2
                    continue
                if text.startswith(self.quote, i):
                    i, self.quote = i + len(self.quote), None
                    continue
                if len(self.quote) == 3 and c == self.quote[0] and len(text) - i < 3:
                    break  # could be the closing triple quote, cut
                i += 1
                continue
            if c in "'\"":
                if len(text) - i < 3 and text[i:] == c * (len(text) - i):
                    break  # '' or " at the end: an empty string or a triple quote's start
                self.quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self.quote)
                continue
            if c in _OPENERS:
                self.stack.append(c)
            elif c in _CLOSERS:
                if not self.stack or _OPENERS.index(self.stack.pop()) != _CLOSERS.index(c):
                    return -1
                if not self.stack:
                    self.pos = i + 1
                    return i
            i += 1
        self.pos = i
        return None


def _plain(value: Any) -> Any:
    """Tuples as lists (JSON has no tuples), the rest as it is."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _calls(source: str) -> list[ToolCall] | None:
    """The calls of a Python list `[name(k=literal, ...), ...]`, or None if it is anything else."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                value = _plain(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            if not is_jsonable(value):
                return None
            args[keyword.arg] = value
        calls.append(ToolCall(node.func.id, dumps(args)))
    return calls


class PythonicParser(ParserBase):
    name = "pythonic"

    def extract(self, text: str) -> Extracted:
        got = _PythonicStream().feed(text, final=True)
        if not got.calls:
            return Extracted(text, [])
        return Extracted(got.content or None, got.calls)

    def stream(self) -> ToolCallStream:
        return _PythonicStream()


class _PythonicStream:
    """start (undecided) -> list (scanning for its `]`) -> after (whitespace, <|python_end|>)
    -> content; a reply that is not a list of calls goes to content from its first character."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = "start"
        self.pos = 0  # after: where to go on skipping; content: text[:pos] is sent
        self.list_start = 0
        self.scan: _ListEnd | None = None
        self.closed_tag = False  # after: <|python_end|> was passed

    def feed(self, delta: str, final: bool = False) -> Extracted:
        self.text += delta
        text, calls = self.text, []
        if self.mode == "start":
            lead = _lead(text)
            if lead is None and not final:
                return Extracted("", [])
            if lead is None or lead < 0:
                self.mode = "content"
            else:
                self.mode, self.list_start, self.scan = "list", lead, _ListEnd(lead)
        if self.mode == "list":
            assert self.scan is not None
            end = self.scan.advance(text)
            if end is None and not final:
                return Extracted("", [])
            found = _calls(text[self.list_start:end + 1]) if end is not None and end >= 0 else None
            if found:
                calls, self.mode, self.pos = found, "after", end + 1
            else:
                self.mode, self.pos = "content", 0
        if self.mode == "after":
            i = skip_ws(text, self.pos)
            if not self.closed_tag:
                rest = text[i:]
                if PYTHON_END.startswith(rest) and rest != PYTHON_END and not final:
                    self.pos = i
                    return Extracted("", calls)
                if rest.startswith(PYTHON_END):
                    self.closed_tag, i = True, skip_ws(text, i + len(PYTHON_END))
            self.pos = i
            if i < len(text) or final:
                self.mode = "content"
        content = ""
        if self.mode == "content":
            content, self.pos = text[self.pos:], len(text)
        return Extracted(content, calls)
