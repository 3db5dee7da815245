"""gpt-oss's harmony format, read from the decoded text. [no torch]

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

Two readers share `parse_harmony`: the gpt_oss reasoning parser (generate/reasoning.py:
analysis -> reasoning, final -> content) and the `openai` tool parser
(tools/parsers/openai.py: messages to `functions.NAME` -> calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
FUNCTIONS = "functions."  # the recipient prefix of a tool call
_OPENERS = (START, CHANNEL)
_TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_BODY_STOPS = (*_TERMINATORS, START)
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")


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
