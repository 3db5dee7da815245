"""Incremental detokenization and stop-string detection.

Text is produced by decoding a short window of tokens twice (with and without the new
ones) and keeping the difference, so tokenizers that merge bytes or drop leading spaces
decode exactly as they would in one piece. A window whose text ends in U+FFFD (a partial
UTF-8 character) is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Decode = Callable[..., str]  # decode(token_ids, skip_special_tokens=...) -> text

# Tokens of context decoded before the new ones (for leading-space handling).
_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class DetokenizerState:
    prefix_offset: int
    read_offset: int


def new_state(num_prompt_tokens: int) -> DetokenizerState:
    return DetokenizerState(max(num_prompt_tokens - _CONTEXT_TOKENS, 0), num_prompt_tokens)


def fast_decode(tokenizer: Any) -> Decode:
    """`tokenizer.decode` for a list of ints, without transformers' per-call argument handling
    where that is provably the same text (the two decodes per generated token were most of an
    engine step's host time at large batches).

    `PreTrainedTokenizerBase.decode` only converts its argument to a list (a no-op for a list
    of ints) and calls `_decode`; the Rust-backed `_decode` is the backend's decode followed by
    the clean-up of tokenization spaces when that is on. So: the backend's decode when the
    tokenizer is a plain Rust-backed one with clean-up off, `_decode` when `decode` is the
    base class's, else `tokenizer.decode` itself (a slow or custom tokenizer)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return tokenizer.decode
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerBase) or cls.decode is not PreTrainedTokenizerBase.decode:
        return tokenizer.decode
    backend = getattr(tokenizer, "_tokenizer", None)
    rust_decode = _rust_backed_decode(cls)
    if rust_decode is not None and backend is not None and not tokenizer.clean_up_tokenization_spaces:
        return backend.decode
    return tokenizer._decode


def _rust_backed_decode(cls: type) -> Any:
    """The transformers class whose `_decode` cls uses, if that is the Rust-backed base's
    (`TokenizersBackend` in transformers 5, `PreTrainedTokenizerFast` in 4), else None."""
    candidates = []
    for module, name in (("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
                         ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast")):
        try:
            base = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        if "_decode" in base.__dict__:
            candidates.append(base.__dict__["_decode"])
    own = next((k.__dict__["_decode"] for k in cls.__mro__ if "_decode" in k.__dict__), None)
    return own if own is not None and any(own is c for c in candidates) else None


def decode_increment(tokenizer: Any, window: list[int], state: DetokenizerState, skip_special_tokens: bool,
                     decode: Decode | None = None, one_token: dict[int, str] | None = None) -> str:
    """Text added by the tokens after `state.read_offset`; advances the state when complete.

    window: the sequence's token ids from `state.prefix_offset` to the end of what is known
    (prompt and output; a few context tokens, not the whole sequence, are copied per call).
    decode: `fast_decode(tokenizer)`, made once by the caller (default: `tokenizer.decode`).
    one_token: the caller's cache of one token's text under this skip_special_tokens (token ->
    decode([token])). Once decoding is under way the prefix is the last step's one token, so
    the cache saves one of the two decodes per generated token."""
    if decode is None:
        decode = tokenizer.decode
    num_prefix = state.read_offset - state.prefix_offset
    if num_prefix == 1 and one_token is not None:
        prefix_text = one_token.get(window[0])
        if prefix_text is None:
            prefix_text = one_token[window[0]] = decode(window[:1], skip_special_tokens=skip_special_tokens)
    else:
        prefix_text = decode(window[:num_prefix], skip_special_tokens=skip_special_tokens)
    full_text = decode(window, skip_special_tokens=skip_special_tokens)
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
