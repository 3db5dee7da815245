"""Incremental detokenization and stop-string detection.

Text is produced by decoding a short window of tokens twice (with and without the new
ones) and keeping the difference, so tokenizers that merge bytes or drop leading spaces
decode exactly as they would in one piece. A window whose text ends in U+FFFD (a partial
UTF-8 character) is held back until the next token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Tokens of context decoded before the new ones (for leading-space handling).
_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int


def new_state(num_prompt_tokens: int) -> DetokenizerState:
    return DetokenizerState(max(num_prompt_tokens - _CONTEXT_TOKENS, 0), num_prompt_tokens)


def decode_increment(tokenizer: Any, window: list[int], state: DetokenizerState, skip_special_tokens: bool) -> str:
    """Text added by the tokens after `state.read_offset`; advances the state when complete.

    window: the sequence's token ids from `state.prefix_offset` to the end of what is known
    (prompt and output; a few context tokens, not the whole sequence, are copied per call)."""
    num_prefix = state.read_offset - state.prefix_offset
    prefix_text = tokenizer.decode(window[:num_prefix], skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        # A tokenizer that rewrites earlier text also gets the length difference.
        delta = full_text[len(prefix_text) :]
        state.prefix_offset = state.read_offset
        state.read_offset = state.prefix_offset + len(window) - num_prefix
        return delta
    return ""


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `num_new_chars` characters of text.

    Returns (index where it starts, the stop string) or None. Only the tail is searched,
    so a match across token boundaries is found exactly once, when its last char arrives.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(len(text) - num_new_chars - len(stop) + 1, 0)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
