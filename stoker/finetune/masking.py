"""Rows -> token ids plus the mask of tokens the loss is taken on (the model's own turns).

Why not trl's `assistant_only_loss`: it needs `{% generation %}` markers in the chat template,
and most shipped templates (the bundled Llama-3-style one included) have none; trl patches only
the templates it knows and refuses the rest. Instead each assistant turn's span is found by
rendering the conversation up to it twice with the model's own template (before the turn, with
the generation prompt; after it) and taking where each rendering's tokens stop agreeing with the
full conversation's. That works for every template that renders earlier turns the same way
whatever follows, needs no markers, and includes the turn's end-of-turn token, so the model
learns to stop. The mask is handed to trl as `assistant_masks`, which its SFTTrainer turns into
labels (-100 elsewhere) for every row.

Tokenization matches what `stoker serve` feeds the model: a rendered chat is encoded with
`add_special_tokens=False` (the template writes BOS itself), a plain prompt with the tokenizer's
special tokens, as /v1/completions does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.finetune.data import ChatRow, CompletionRow, DataError, Row


@dataclass(frozen=True)
class Features:
    line: int
    input_ids: list[int]
    assistant_masks: list[int]  # 1 where the label is the token itself, 0 where it is -100
    truncated: bool

    @property
    def num_trained(self) -> int:
        return sum(self.assistant_masks)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat_features(tokenizer: Any, row: ChatRow) -> tuple[list[int], list[int]]:
    def encode(messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    ids = encode(row.messages, False)
    mask = [0] * len(ids)
    for i, message in enumerate(row.messages):
        if message["role"] != "assistant" or i < row.train_from:
            continue
        # The turn's tokens: after its header (the generation prompt) through its end-of-turn.
        start = common_prefix_len(encode(row.messages[:i], True), ids)
        end = common_prefix_len(encode(row.messages[: i + 1], False), ids)
        mask[start:end] = [1] * (end - start)
    return ids, mask


def completion_features(tokenizer: Any, row: CompletionRow) -> tuple[list[int], list[int]]:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token: a completion could not be taught to stop")
    prompt_ids = tokenizer.encode(row.prompt)
    # EOS closes the completion so the adapter learns to stop (trl appends it the same way).
    ids = tokenizer.encode(row.prompt + row.completion) + [tokenizer.eos_token_id]
    # Where the two tokenizations part, not len(prompt_ids): BPE may merge across the boundary.
    start = common_prefix_len(prompt_ids, ids)
    return ids, [0] * start + [1] * (len(ids) - start)


def featurize(tokenizer: Any, row: Row, max_seq_len: int, where: str) -> Features:
    """One row's ids and loss mask, cut to `max_seq_len`; DataError when no target token survives."""
    ids, mask = chat_features(tokenizer, row) if isinstance(row, ChatRow) else completion_features(tokenizer, row)
    if not any(mask):
        raise DataError(f"{where}: the chat template renders no assistant tokens for this row (it may rewrite "
                        "earlier turns depending on what follows)")
    first = mask.index(1)
    if first >= max_seq_len:
        raise DataError(f"{where}: the prompt alone is {first} tokens, at or above --max-seq-len {max_seq_len}: "
                        "nothing would be left to learn from; raise --max-seq-len or shorten the row")
    truncated = len(ids) > max_seq_len
    return Features(row.line, ids[:max_seq_len], mask[:max_seq_len], truncated)
