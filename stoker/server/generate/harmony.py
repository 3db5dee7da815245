"""gpt-oss's harmony format, read from the decoded text, and its tool calls (`--tool-call-parser openai`). [no torch]

The `openai-harmony` package parses harmony from token ids, but it must download its o200k
vocabulary at run time, which a server without internet access cannot; the special tokens
appear as text when the server keeps them (skip_special_tokens false), so the text is parsed.

A reply is a sequence of messages; the prompt ends with `<|start|>assistant`, so the first one
starts at its header:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

A header runs to `<|message|>` and names the channel (`<|channel|>X`), maybe a recipient
(`to=X`, before or after the channel) and a constraint (`<|constrain|>json`). A body ends at
`<|end|>`, `<|call|>` or `<|return|>` (the last two are stop tokens, usually not in the text),
at the next `<|start|>`, or at the end. Text outside any message is kept as text.

`openai` tool parser: a message to `functions.NAME` whose body is a JSON object is a call (its
arguments re-serialized as the other parsers do); one whose body is not stays in the content as
written. `final` and `commentary` bodies are content; `analysis` is reasoning, dropped here (the
gpt_oss reasoning parser, generate/reasoning.py, returns it). Streamed, a call goes out once its
message ends; content as it comes, an end that could begin a marker held back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from stoker.server.generate.tools.parsers import Extracted, ToolCall

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_OPENERS = (START, CHANNEL)
_TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_BODY_STOPS = (*_TERMINATORS, START)
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
_FUNCTIONS = "functions."


def _held(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text[start:] that could begin one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(text) - start, len(marker) - 1), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def _first(text: str, markers: tuple[str, ...], start: int) -> tuple[int, str] | None:
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found) if found else None


@dataclass
class Piece:
    """Text outside messages (is_text), or one message: its raw span [start, end) and its body."""

    start: int
    end: int
    is_text: bool = False
    channel: str | None = None
    recipient: str | None = None
    body_start: int = 0
    body_end: int = 0
    complete: bool = True


@dataclass
class HarmonyParse:
    pieces: list[Piece] = field(default_factory=list)
    complete_end: int = 0  # text[:complete_end] is complete pieces: no later text changes them


def parse_harmony(text: str, pos: int = 0, final: bool = True) -> HarmonyParse:
    """The pieces of text[pos:]. Not final: an unfinished piece reaches only as far as no later
    text can change (a body's end that could begin a marker is left out; a header still being
    written is left out whole); final: everything, an unfinished header dropped."""
    out = HarmonyParse(complete_end=pos)
    while pos < len(text):
        opener = _first(text, _OPENERS, pos)
        if opener is None or opener[0] > pos:  # text before the next message
            end = opener[0] if opener else (len(text) if final else len(text) - _held(text, pos, _OPENERS))
            if end > pos:
                out.pieces.append(Piece(pos, end, is_text=True, complete=opener is not None or final))
            if opener is None:
                out.complete_end = len(text) if final else out.complete_end
                break
            pos = out.complete_end = opener[0]
        header_end = text.find(MESSAGE, pos)
        if header_end < 0:
            if final:
                out.complete_end = len(text)  # a header cut off: nothing to show of it
            break
        header = text[pos:header_end]
        channel = _CHANNEL_RE.search(header)
        recipient = _RECIPIENT_RE.search(header)
        body_start = header_end + len(MESSAGE)
        stop = _first(text, _BODY_STOPS, body_start)
        piece = Piece(pos, 0, channel=channel.group(1) if channel else None,
                      recipient=recipient.group(1) if recipient else None, body_start=body_start)
        if stop is not None:
            piece.body_end = stop[0]
            piece.end = stop[0] + (len(stop[1]) if stop[1] != START else 0)
        elif final:
            piece.body_end = piece.end = len(text)
        else:
            piece.body_end = piece.end = len(text) - _held(text, body_start, _BODY_STOPS)
            piece.complete = False
        out.pieces.append(piece)
        if not piece.complete:
            break
        pos = out.complete_end = piece.end
    return out


def _call(text: str, piece: Piece) -> ToolCall | None:
    """The call a message to functions.NAME makes, or None if its body is not a JSON object."""
    name = (piece.recipient or "")[len(_FUNCTIONS):]
    try:
        args = json.loads(text[piece.body_start:piece.body_end])
    except ValueError:
        return None
    if not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _tool_split(text: str, parsed: HarmonyParse) -> tuple[str, list[ToolCall]]:
    """(content, calls) of the parsed pieces; a call only once its message is complete."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for piece in parsed.pieces:
        if piece.is_text:
            content.append(text[piece.start:piece.end])
        elif piece.recipient is not None:
            if not piece.complete:
                continue  # told once whole: a call or, not being one, its text
            call = _call(text, piece) if piece.recipient.startswith(_FUNCTIONS) else None
            if call is None:
                content.append(text[piece.start:piece.end])
            else:
                calls.append(call)
        elif piece.channel != "analysis":
            content.append(text[piece.body_start:piece.body_end])
    return "".join(content), calls


class HarmonyToolParser:
    name = "openai"

    def extract(self, text: str) -> Extracted:
        content, calls = _tool_split(text, parse_harmony(text, 0, True))
        return Extracted((content or None) if calls else content, calls)

    def stream(self) -> _HarmonyToolStream:
        return _HarmonyToolStream()


class _HarmonyToolStream:
    """Complete messages are told once; the text after them is parsed from there on."""

    def __init__(self) -> None:
        self.text = ""
        self.base = 0  # text[:base] is complete pieces, already sent
        self.sent = 0  # characters of the content of text[base:] already sent
        self.called = False

    def feed(self, delta: str, final: bool = False) -> Extracted:
        self.text += delta
        parsed = parse_harmony(self.text, self.base, final)
        content, calls = _tool_split(self.text, parsed)
        out = Extracted(content[self.sent:], calls)
        self.called = self.called or bool(calls)
        if parsed.complete_end > self.base:
            done, _ = _tool_split(self.text, parse_harmony(self.text[:parsed.complete_end], self.base, True))
            self.sent = len(content) - len(done)
            self.text, self.base = self.text[parsed.complete_end:], 0  # complete pieces are never read again
        else:
            self.sent = len(content)
        # Calls are only ever in complete pieces, so each is handed out once: the base moves past it.
        return out
