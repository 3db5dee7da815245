"""Tool calls out of a model's text, for `tool_choice: "auto"` (`--tool-call-parser`). [no torch]

Each parser has a whole-text `extract(text) -> Extracted` and a per-choice `stream()` whose
`feed(delta, final) -> Extracted` takes the text as it is generated. A call is handed out only
once its JSON is complete (never a half-written `arguments`), so streamed calls and content,
put back together, equal what `extract` gives for the whole text, however it was chunked.
Arguments are always re-serialized as `json.dumps(args, ensure_ascii=False)`.

* `hermes` (Hermes 2/3, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, with text around them. A block whose body is not such an object stays in the content,
  as written; so does an unclosed block that does not parse at the end.
* `llama3_json` (Llama 3.x JSON tool calling): the reply starts (after optional whitespace and
  `<|python_tag|>`) with `{"name": ..., "parameters": {...}}` (or `"arguments"`), several
  separated by `;`. Parsing stops at the first thing that is not such an object: what follows
  is content. A reply that does not start with `{` is plain content.
* `required` (not a `--tool-call-parser`): the JSON array `[{"name", "parameters"}, ...]` the
  grammar forces for `tool_choice: "required"`.

Content: with no call found it is the whole text, exactly. With calls, `hermes` gives the text
outside the calls without its trailing whitespace (None if nothing is left); `llama3_json` what
follows the last call (None if nothing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


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

    def extract(self, text: str) -> Extracted: ...

    def stream(self) -> ToolCallStream: ...


def _call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded object {"name": str, <one of args_keys>: {...}}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    present = [k for k in args_keys if k in obj]
    if len(present) > 1:
        return None
    args = obj[present[0]] if present else {}
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker` (held back while streaming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ------------------------------------------------------------------------------- hermes
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_ARGS = ("arguments", "parameters")


def _hermes_block(body: str) -> ToolCall | None:
    try:
        return _call(json.loads(body), _HERMES_ARGS)
    except ValueError:
        return None


class HermesParser:
    name = "hermes"

    def extract(self, text: str) -> Extracted:
        pieces: list[str] = []  # text outside valid calls (invalid blocks as written)
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(_OPEN, pos)) >= 0:
            pieces.append(text[pos:start])
            end = text.find(_CLOSE, start + len(_OPEN))
            stop = end + len(_CLOSE) if end >= 0 else len(text)
            call = _hermes_block(text[start + len(_OPEN) : end if end >= 0 else len(text)])
            if call is None:
                pieces.append(text[start:stop])
            else:
                calls.append(call)
            pos = stop
        pieces.append(text[pos:])
        if not calls:
            return Extracted(text, [])
        return Extracted("".join(pieces).rstrip() or None, calls)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream:
    """Outside a block, text goes out as content, except an end that could begin `<tool_call>`
    and trailing whitespace (dropped at the end once a call was made, as `extract` drops it).
    Inside a block, nothing goes out until `</tool_call>` (or the end) closes it."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # text[:pos] is handled
        self.block: int | None = None  # where the open block's <tool_call> starts
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
        while True:
            if self.block is None:
                start = text.find(_OPEN, self.pos)
                if start < 0:
                    end = len(text) if final else len(text) - _held_prefix(text[self.pos:], _OPEN)
                    self._content(text[self.pos:end], content)
                    self.pos = end
                    break
                self._content(text[self.pos:start], content)
                self.block, self.pos = start, start + len(_OPEN)
            else:
                close = text.find(_CLOSE, max(self.pos, self.block + len(_OPEN)))
                if close < 0 and not final:
                    # `</tool_call>` may be split across deltas: search again from near the end
                    self.pos = max(self.block + len(_OPEN), len(text) - len(_CLOSE) + 1)
                    break
                stop = close + len(_CLOSE) if close >= 0 else len(text)
                call = _hermes_block(text[self.block + len(_OPEN) : close if close >= 0 else len(text)])
                if call is None:
                    self._content(text[self.block:stop], content)
                else:
                    calls.append(call)
                    self.called = True
                self.block, self.pos = None, stop
        if final and not self.called:
            content.append(self.pending_ws)  # no call: the content is the text exactly
            self.pending_ws = ""
        return Extracted("".join(content), calls)


# ------------------------------------------------------------------------------- llama3_json
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


def _skip_separators(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SEPARATORS:
        i += 1
    return i


def _llama_object(text: str, i: int) -> tuple[ToolCall | None, int] | None:
    """(call or None if the object is not a call, end) for a complete object at i; None if none ends there."""
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return None
    return _call(obj, _LLAMA_ARGS), end


class Llama3JsonParser:
    name = "llama3_json"

    def extract(self, text: str) -> Extracted:
        i = _llama_start(text)
        if i is None or i < 0:
            return Extracted(text, [])
        calls: list[ToolCall] = []
        while i < len(text) and text[i] == "{":
            got = _llama_object(text, i)
            if got is None or got[0] is None:
                break
            calls.append(got[0])
            i = _skip_separators(text, got[1])
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
            i = _skip_separators(text, self.pos)
            if i == len(text):
                if final:
                    self._to_content(i)
                break
            if text[i] != "{":
                self._to_content(i)
                break
            got = _llama_object(text, i) if "}" in text[i:] else None
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


# ------------------------------------------------------------------------------- required
class RequiredParser:
    """The array `tool_choice: "required"` is constrained to: `[{"name":..,"parameters":{..}},..]`.
    Whatever does not complete a call (an output cut by max_tokens) is content."""

    name = "required"

    def extract(self, text: str) -> Extracted:
        stream = _RequiredStream()
        return stream.feed(text, final=True)

    def stream(self) -> ToolCallStream:
        return _RequiredStream()


class _RequiredStream:
    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # text[:pos] is parsed
        self.opened = False
        self.done = False

    def feed(self, delta: str, final: bool = False) -> Extracted:
        self.text += delta
        text, calls = self.text, []
        while not self.done:
            i = _skip_separators(text, self.pos)
            if not self.opened:
                if i < len(text) and text[i] == "[":
                    self.opened, self.pos = True, i + 1
                    continue
                break
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i < len(text) and text[i] == "]":
                self.done, self.pos = True, i + 1
                break
            got = _llama_object(text, i) if i < len(text) and text[i] == "{" and "}" in text[i:] else None
            if got is None or got[0] is None:
                break
            calls.append(got[0])
            self.pos = got[1]
        content = ""
        if final:
            content, self.pos = text[self.pos:].lstrip(" \t\r\n,").rstrip(), len(text)
        return Extracted((content or None) if final else "", calls)


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}
REQUIRED = RequiredParser()


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}") from None
