"""Repetition, frequency and presence penalties, batched over rows.

Definitions as vLLM / OpenAI use them:
- repetition_penalty (CTRL paper, HF): for every token seen in the prompt or the output,
  a positive logit is divided by the penalty, a negative one multiplied by it;
- frequency_penalty: logit -= penalty x (times the token appears in the output);
- presence_penalty: logit -= penalty x (1 if it appears in the output at all).
"""

from __future__ import annotations

import torch


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(S, V) int counts of each token id per row."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.int32, device=device)
    for row, tokens in enumerate(token_lists):
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.int64, device=device)
            counts[row].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts


def apply_penalties(
    logits: torch.Tensor,  # (S, V) float32, modified in place
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition: torch.Tensor,  # (S,)
    frequency: torch.Tensor,  # (S,)
    presence: torch.Tensor,  # (S,)
    any_repetition: bool = True,  # known on the host: avoids a device sync to find out
) -> torch.Tensor:
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_ids, vocab_size, logits.device)
    if any_repetition:
        seen = (token_counts(prompt_ids, vocab_size, logits.device) + output_counts) > 0
        penalty = repetition[:, None].expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    logits = logits - frequency[:, None] * output_counts
    logits = logits - presence[:, None] * (output_counts > 0)
    return logits
