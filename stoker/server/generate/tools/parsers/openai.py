"""gpt-oss's tool calls in harmony (`--tool-call-parser openai`, vLLM's name). [no torch]

A message to `functions.NAME` whose body is a JSON object is a call (its arguments re-serialized
as the other parsers do); one whose body is not stays in the content as written. `final` and
`commentary` bodies are content; `analysis` is reasoning, dropped here (the gpt_oss reasoning
parser, generate/reasoning.py, returns it). Streamed, a call goes out once its message ends;
content as it comes, an end that could begin a marker held back. The format and its reading:
generate/harmony.py.

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
"""

from __future__ import annotations

import json

from stoker.server.generate.harmony import FUNCTIONS as _FUNCTIONS
from stoker.server.generate.harmony import HarmonyParse, Piece, parse_harmony
from stoker.server.generate.tools.parsers.base import Extracted, ParserBase, ToolCall


def _call(text: str, piece: Piece) -> ToolCall | None:
    """The call a message to functions.NAME makes, or None if its body is not a JSON object."""
    name = (piece.recipient or "")[len(_FUNCTIONS):]
    try:
        args = json.loads(text[piece.body_start:piece.body_end])
        if not name or not isinstance(args, dict):
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's stack
        return None


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


class HarmonyToolParser(ParserBase):
    name = "openai"
    keeps_special_tokens = True  # <|channel|>, <|message|>, <|call|> are special tokens in gpt-oss's tokenizer

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
