"""A reasoning model's thinking, split out of its text (`--reasoning-parser`). [no torch]

Each parser has a whole-text `extract(text) -> (reasoning | None, content | None)` and a
per-choice `stream()` whose `feed(delta, final) -> (reasoning delta, content delta)` takes the
text as it is generated. Streamed deltas, put back together, equal what `extract` gives for the
whole text however the text was chunked (None reads as ""): a stream only releases text whose
side (reasoning or content) no later text can change, and holds the rest.

* `deepseek_r1`: `<think>reasoning</think>content`. The chat template may already have written
  `<think>` into the prompt, so an opening tag is optional; without `</think>` all of the text is
  reasoning (the model was cut off while thinking).
* `qwen3`: the same tags, but without `</think>` all of the text is content (a template called
  with `enable_thinking: false` makes the model answer without thinking). Until `</think>` or the
  end decides it, a stream holds the text back.
* `granite`: `Here is my thought process: ... Here is my response: ...` (or `Here's`); a text
  that does not open with the first phrase is all content, and so is one that never reaches the
  second (held back until then when streamed).
* `gpt_oss`: OpenAI's harmony format (generate/harmony.py): `analysis` messages are reasoning,
  `final` messages (and `commentary` preambles) content; a message addressed to a recipient
  (`to=functions.NAME`, a tool call, whatever its channel) stays in the content as written, for
  `--tool-call-parser openai` to parse.

Empty reasoning or content is None. `end_marker` is the text that ends the reasoning: structured
outputs are enforced only once the output holds its tokens (see chat.py).
"""

from __future__ import annotations

from typing import Protocol

from stoker.server.generate.harmony import HarmonyParse, parse_harmony

Split = tuple[str | None, str | None]


class ReasoningStream(Protocol):
    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `delta` releases ("" for nothing)."""
        ...


class ReasoningParser(Protocol):
    name: str
    end_marker: str
    # True when the markers may be special tokens, which skip_special_tokens would drop
    keeps_special_tokens: bool

    def extract(self, text: str) -> Split: ...

    def stream(self) -> ReasoningStream: ...


def held_prefix(text: str, *markers: str) -> int:
    """Length of the longest end of `text` that could begin one of `markers` (held while streaming)."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


def _none(text: str) -> str | None:
    return text or None


class _Partial(Protocol):
    def __call__(self, text: str, final: bool) -> tuple[str, str, int | None]:
        """(reasoning, content, where the content starts once decided: None while undecided).
        Not final: only what no further text can change (both are prefixes of the final split)."""
        ...


class _SplitStream:
    """Streams a parser given as `partial(text, final)`: each feed emits what grew since the
    last one. Once the reasoning has ended, the rest of the text is content and flows through
    without re-reading the text."""

    def __init__(self, partial: _Partial) -> None:
        self.partial = partial
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.through = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if self.through:
            return "", delta
        self.text += delta
        reasoning, content, content_start = self.partial(self.text, final)
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        if content_start is not None and content_start + len(content) == len(self.text):
            self.through, self.text = True, ""  # the rest is content: nothing more to look for
        return out


# ------------------------------------------------------------------------------- <think> tags
_THINK, _END_THINK = "<think>", "</think>"


def _think_start(text: str, tag: str) -> int | None:
    """Where the reasoning starts: after an opening `tag` (leading whitespace allowed), else 0;
    None while the text could still be the start of `tag`."""
    stripped = text.lstrip()
    if stripped.startswith(tag):
        return len(text) - len(stripped) + len(tag)
    if tag.startswith(stripped):
        return None
    return 0


class _ThinkParser:
    start_tag = _THINK
    end_marker = _END_THINK
    keeps_special_tokens = True
    unclosed_is_reasoning: bool  # without </think>: all reasoning (R1) or all content (qwen3)

    def partial(self, text: str, final: bool) -> tuple[str, str, int | None]:
        start = _think_start(text, self.start_tag)
        if start is None:  # empty or a piece of `<think>`
            if not final:
                return "", "", None
            start = 0
        end = text.find(self.end_marker, start)
        if end >= 0:
            content_start = end + len(self.end_marker)
            return text[start:end], text[content_start:], content_start
        if self.unclosed_is_reasoning:
            return text[start:len(text) if final else len(text) - held_prefix(text, self.end_marker)], "", None
        if final:
            return "", text, 0
        return "", "", None

    def extract(self, text: str) -> Split:
        reasoning, content, _ = self.partial(text, True)
        return _none(reasoning), _none(content)

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self)


class _ThinkStream:
    """`_ThinkParser.partial` kept incremental, as a model may think for tens of thousands of
    tokens: after the opening is decided, only the unsent end of the text is kept (deepseek_r1:
    the part that may begin `</think>`), or, while undecided (qwen3), the search for `</think>`
    goes on from where it stopped."""

    def __init__(self, parser: _ThinkParser) -> None:
        self.parser = parser
        self.text = ""  # not yet sent
        self.start: int | None = None  # where the reasoning starts in self.text, once decided
        self.searched = 0  # self.text[start:searched] holds no end marker start (qwen3)
        self.through = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if self.through:
            return "", delta
        self.text += delta
        parser, text = self.parser, self.text
        if self.start is None:
            self.start = _think_start(text, parser.start_tag)
            if self.start is None:
                if not final:
                    return "", ""
                self.start = 0
            self.searched = self.start
        marker = parser.end_marker
        end = text.find(marker, self.searched)
        if end >= 0:
            self.through, self.text = True, ""
            return text[self.start:end], text[end + len(marker):]
        if final:
            self.through, self.text = True, ""
            return (text[self.start:], "") if parser.unclosed_is_reasoning else ("", text)
        self.searched = max(self.start, len(text) - len(marker) + 1)
        if not parser.unclosed_is_reasoning:
            return "", ""  # qwen3: undecided until </think> or the end
        keep = len(text) - held_prefix(text, marker)
        out, self.text, self.start, self.searched = text[self.start:keep], text[keep:], 0, 0
        return out, ""


class DeepSeekR1Parser(_ThinkParser):
    name = "deepseek_r1"
    unclosed_is_reasoning = True


class Qwen3Parser(_ThinkParser):
    name = "qwen3"
    unclosed_is_reasoning = False


# ------------------------------------------------------------------------------- granite
_THOUGHT = ("Here is my thought process:", "Here's my thought process:")
_RESPONSE = ("Here is my response:", "Here's my response:")


class GraniteParser:
    name = "granite"
    end_marker = _RESPONSE[0]
    keeps_special_tokens = False  # plain-text markers

    def partial(self, text: str, final: bool) -> tuple[str, str, int | None]:
        stripped = text.lstrip()
        opener = next((m for m in _THOUGHT if stripped.startswith(m)), None)
        if opener is None:
            if not final and any(m.startswith(stripped) for m in _THOUGHT):
                return "", "", None  # could still open with the phrase
            return "", text, 0
        start = len(text) - len(stripped) + len(opener)
        found = [(i, m) for m in _RESPONSE if (i := text.find(m, start)) >= 0]
        if found:
            end, marker = min(found)
            return text[start:end], text[end + len(marker):], end + len(marker)
        return ("", text, 0) if final else ("", "", None)  # never answered: all content, as vLLM

    def extract(self, text: str) -> Split:
        reasoning, content, _ = self.partial(text, True)
        return _none(reasoning), _none(content)

    def stream(self) -> ReasoningStream:
        return _SplitStream(self.partial)


# ------------------------------------------------------------------------------- gpt-oss
class GptOssParser:
    name = "gpt_oss"
    end_marker = "<|channel|>final<|message|>"
    keeps_special_tokens = True  # <|channel|>, <|message|>, ... are special tokens

    def extract(self, text: str) -> Split:
        reasoning, content = _harmony_split(text, parse_harmony(text, 0, final=True))
        return _none(reasoning), _none(content)

    def stream(self) -> ReasoningStream:
        return _HarmonyReasoningStream()


def _harmony_split(text: str, parsed: HarmonyParse) -> tuple[str, str]:
    """(reasoning, content) of the parsed messages and text between them."""
    reasoning, content = [], []
    for piece in parsed.pieces:
        if piece.is_text:
            content.append(text[piece.start:piece.end])
        elif piece.recipient is not None:  # a call (gpt-oss may address one from analysis too)
            content.append(text[piece.start:piece.end])  # as written, for the tool parser
        elif piece.channel == "analysis":
            reasoning.append(text[piece.body_start:piece.body_end])
        else:
            content.append(text[piece.body_start:piece.body_end])
    return "".join(reasoning), "".join(content)


class _HarmonyReasoningStream:
    """Complete messages are split once and the text after them is parsed from there on."""

    def __init__(self) -> None:
        self.text = ""
        self.base = 0  # text[:base] is complete messages, already sent
        self.sent_reasoning = 0  # of the split of text[base:]
        self.sent_content = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        parsed = parse_harmony(self.text, self.base, final)
        reasoning, content = _harmony_split(self.text, parsed)
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        if parsed.complete_end > self.base:  # re-split only the unfinished tail from now on
            done = parse_harmony(self.text[:parsed.complete_end], self.base, True)
            r, c = _harmony_split(self.text, done)
            self.sent_reasoning, self.sent_content = len(reasoning) - len(r), len(content) - len(c)
            self.text, self.base = self.text[parsed.complete_end:], 0  # complete messages are never read again
        else:
            self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out


PARSERS: dict[str, ReasoningParser] = {
    p.name: p for p in (DeepSeekR1Parser(), Qwen3Parser(), GraniteParser(), GptOssParser())}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}") from None
