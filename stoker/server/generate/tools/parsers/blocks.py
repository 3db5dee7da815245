"""Formats whose calls sit in marked blocks anywhere in the text (hermes, qwen3_coder, glm45,
mistral, deepseek_v3, kimi_k2). [no torch]

A block opens at `open_marker`; where it ends is the format's (`block_end`: by default the next
`close_marker`, or the end of the text). A block that parses gives its calls; one that does not
stays in the content as written, so no text is ever lost. The content is the text outside the
calls: exactly the whole text when no call was found; otherwise without its trailing whitespace,
None if nothing is left.
"""

from __future__ import annotations

from collections.abc import Callable

from stoker.server.generate.tools.parsers.base import (Extracted, ParserBase, ToolCall, ToolCallStream, held_prefix,
                                                     skip_ws)


class BlockParser(ParserBase):
    open_marker = ""
    close_marker = ""

    def block_end(self, text: str, body: int, seen: int, final: bool) -> tuple[int, int] | None:
        """(where the body ends, where the block ends) for the block whose body starts at `body`;
        None while that cannot be told yet (never when final). `text[:seen]` was looked at before
        (a search may resume there)."""
        close = text.find(self.close_marker, max(body, seen - len(self.close_marker) + 1))
        if close >= 0:
            return close, close + len(self.close_marker)
        return (len(text), len(text)) if final else None

    def parse_block(self, body: str) -> list[ToolCall] | None:
        """The calls in a block's body; None (or no call) keeps the block in the content."""
        raise NotImplementedError

    def parsed(self, body: str) -> list[ToolCall] | None:
        try:
            return self.parse_block(body)
        except RecursionError:  # arguments nested deeper than Python's stack: not a call, content
            return None

    def extract(self, text: str) -> Extracted:
        pieces: list[str] = []  # text outside valid calls (invalid blocks as written)
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(self.open_marker, pos)) >= 0:
            pieces.append(text[pos:start])
            body = start + len(self.open_marker)
            got = self.block_end(text, body, body, True)
            assert got is not None
            body_end, stop = got
            found = self.parsed(text[body:body_end])
            if found:
                calls += found
            else:
                pieces.append(text[start:stop])
            pos = stop
        pieces.append(text[pos:])
        if not calls:
            return Extracted(text, [])
        return Extracted("".join(pieces).rstrip() or None, calls)

    def stream(self) -> ToolCallStream:
        return BlockStream(self)


class BlockStream:
    """Outside a block, text goes out as content, except an end that could begin the open marker
    and trailing whitespace (dropped at the end once a call was made, as `extract` drops it).
    Inside a block, nothing goes out until the block ends."""

    def __init__(self, parser: BlockParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0  # text[:pos] is handled
        self.block: int | None = None  # where the open block's marker starts
        self.seen = 0  # inside a block: text[:seen] was searched for its end
        self.pending_ws = ""  # whitespace at the end of the content, not yet sent
        self.called = False

    def _content(self, piece: str, out: list[str]) -> None:
        piece = self.pending_ws + piece
        kept = piece.rstrip()
        self.pending_ws = piece[len(kept):]
        out.append(kept)

    def feed(self, delta: str, final: bool = False) -> Extracted:
        self.text += delta
        text, content, calls = self.text, [], []
        opener = self.parser.open_marker
        while True:
            if self.block is None:
                start = text.find(opener, self.pos)
                if start < 0:
                    end = len(text) if final else len(text) - held_prefix(text[self.pos:], opener)
                    self._content(text[self.pos:end], content)
                    self.pos = end
                    break
                self._content(text[self.pos:start], content)
                self.block, self.pos = start, start + len(opener)
                self.seen = self.pos
            else:
                body = self.block + len(opener)
                got = self.parser.block_end(text, body, self.seen, final)
                if got is None:
                    self.seen = len(text)
                    break
                body_end, stop = got
                found = self.parser.parsed(text[body:body_end])
                if found:
                    calls += found
                    self.called = True
                else:
                    self._content(text[self.block:stop], content)
                self.block, self.pos = None, stop
        if final and not self.called:
            content.append(self.pending_ws)  # no call: the content is the text exactly
            self.pending_ws = ""
        return Extracted("".join(content), calls)


def marked_calls(body: str, begin: str, end: str, one: Callable[[str], ToolCall | None]) -> list[ToolCall] | None:
    """The calls of a section body made of `begin ... end` elements (whitespace between them),
    each read by `one`; None if anything else is there or one does not read."""
    calls: list[ToolCall] = []
    i = skip_ws(body, 0)
    while i < len(body):
        if not body.startswith(begin, i):
            return None
        stop = body.find(end, i)
        if stop < 0:
            return None
        call = one(body[i + len(begin):stop])
        if call is None:
            return None
        calls.append(call)
        i = skip_ws(body, stop + len(end))
    return calls or None
