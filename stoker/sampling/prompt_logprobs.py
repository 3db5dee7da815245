"""Prompt log-probabilities: how likely the model found each prompt token given those before.

Position p's logits score prompt token p + 1, so a prefill chunk scores the prompt tokens after
each of its positions. The logits of a chunk are computed a slice of rows at a time: a long
prompt never holds a (prompt_len, vocab) tensor, only (rows_per_slice, vocab), about 64 MiB of
float32 whatever the vocabulary. The values are the model's raw log-softmax (as vLLM V1
reports them): no temperature, penalty or bias touches a prompt token.

Under tensor parallelism every rank runs `compute_logits` on the same slices (the LM head
gathers its vocabulary shards to rank 0, a collective); only rank 0 gets logits back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stoker.core.step import PromptLogprobChunk

# Rows per slice: (rows, vocab) float32 logits plus their log-softmax stay near 2 x 64 MiB.
_SLICE_ELEMENTS = 1 << 24


def rows_per_slice(vocab_size: int) -> int:
    return max(1, _SLICE_ELEMENTS // max(vocab_size, 1))


@torch.inference_mode()
def score_prompt(
    hidden: torch.Tensor,
    targets: list[int],
    num_top: int,
    first_index: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    vocab_size: int,
) -> PromptLogprobChunk | None:
    """hidden: (len(targets), hidden) states of the positions that precede each target.
    Returns the chunk on the rank that gets logits, None on the others (which still take part
    in every slice's collective)."""
    step = rows_per_slice(vocab_size)
    logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_vals: list[list[float]] = []
    for start in range(0, len(targets), step):
        logits = compute_logits(hidden[start : start + step])  # (rows, vocab) float32 or None
        if logits is None:
            continue
        lp = torch.log_softmax(logits, dim=-1)
        want = torch.tensor(targets[start : start + step], dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, want[:, None])  # (rows, 1)
        logprobs += chosen[:, 0].tolist()
        ranks += ((lp > chosen).sum(dim=-1) + 1).tolist()
        if num_top > 0:
            vals, ids = lp.topk(min(num_top, lp.shape[-1]), dim=-1)
            top_ids += ids.tolist()
            top_vals += vals.tolist()
        else:
            top_ids += [[] for _ in range(lp.shape[0])]
            top_vals += [[] for _ in range(lp.shape[0])]
    if not logprobs:
        return None
    return PromptLogprobChunk(first_index, list(targets), logprobs, ranks, top_ids, top_vals)
