"""StepMessage -> the flat tensors one packed forward needs.

No padding to the longest sequence: the step's tokens are concatenated (T = sum of each
sequence's new tokens). The message lists sequences with one new token (decodes) first, so
attention can run them as a single batched paged-decode call.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import numpy as np
import torch

from stoker.core.step import PromptLogprobChunk, SeqStep, StepMessage
from stoker.layers.attention import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) rows of the hidden states to sample from (N = S without drafts)
    sampled: list[SeqStep]  # the S sequences that sample, in row order (each num_sampled rows)
    ordered: list[SeqStep]  # all scheduled sequences, decodes first
    # Filled by the forward on the rank that gets logits: seq_id -> its prompt tokens' scores.
    prompt_logprobs: dict[int, PromptLogprobChunk] = field(default_factory=dict)
    has_drafts: bool = False  # some sampling sequence verifies drafts (more rows than sequences)


# A sequence with at least this many new tokens (a prefill chunk) gets its slots from numpy;
# below it a list comprehension is cheaper than building the arrays.
_VECTOR_SLOTS_FROM = 64


def prepare_inputs(step: StepMessage, block_size: int, device: torch.device) -> ModelInputs:
    ordered = step.seqs
    bs = block_size
    num_decodes = 0
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens_q = [0]
    context_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[SeqStep] = []
    max_blocks = 0
    end = 0
    # One pass, per sequence rather than per token where it can: at a large decode batch this
    # is host time of every step (benchmarks/step_overhead.py).
    for s in ordered:
        tokens = s.token_ids
        n = len(tokens)
        start = s.start_pos
        table = s.block_table
        if len(table) > max_blocks:
            max_blocks = len(table)
        input_ids += tokens
        if n == 1:
            num_decodes += 1
            positions.append(start)
            slot_mapping.append(table[start // bs] * bs + start % bs)
        elif n >= _VECTOR_SLOTS_FROM:
            pos = np.arange(start, start + n, dtype=np.int64)
            positions += range(start, start + n)
            slot_mapping += (np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist()
        else:
            span = range(start, start + n)
            positions += span
            slot_mapping += [table[p // bs] * bs + p % bs for p in span]
        end += n
        cu_seqlens_q.append(end)
        context_lens.append(start + n)
        if s.do_sample:
            # the last known token's row and one per draft: (1 + len(drafts)) rows, in order
            num_sampled = 1 + len(s.draft_token_ids)
            if num_sampled == 1:
                logits_indices.append(end - 1)
            else:
                logits_indices += range(end - num_sampled, end)
            sampled.append(s)
    # Padded with 0, built as one flat list (a nested list converts to a tensor element by element)
    flat_tables: list[int] = []
    zeros = [0] * max_blocks
    for s in ordered:
        table = s.block_table
        flat_tables += table
        if len(table) < max_blocks:
            flat_tables += zeros[len(table):]

    def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        # Built on the host, copied once; pinned + non_blocking would overlap on GPU.
        return _host_tensor(values, dtype).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=as_tensor(slot_mapping, torch.int64),
        block_tables=as_tensor(flat_tables, torch.int32).view(len(ordered), max_blocks),
        context_lens=as_tensor(context_lens, torch.int32),
        cu_seqlens_q=cu_seqlens_q,
        context_lens_list=context_lens,
        num_decodes=num_decodes,
        prefill_cu_seqlens_q=(
            as_tensor([x - cu_seqlens_q[num_decodes] for x in cu_seqlens_q[num_decodes:]], torch.int32)
            if device.type == "cuda" and num_decodes < len(ordered) else None
        ),
    )
    return ModelInputs(
        input_ids=as_tensor(input_ids, torch.int64),
        positions=as_tensor(positions, torch.int64),
        attn_metadata=metadata,
        logits_indices=as_tensor(logits_indices, torch.int64),
        sampled=sampled,
        ordered=ordered,
        has_drafts=len(logits_indices) > len(sampled),
    )


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def _host_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a list of ints: through array.array, about 3x cheaper than torch.tensor
    (which converts element by element); the tensor keeps the array alive."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)
