"""StepMessage -> the flat tensors one packed forward needs.

No padding to the longest sequence: the step's tokens are concatenated (T = sum of each
sequence's new tokens). The message lists sequences with one new token (decodes) first, so
attention can run them as a single batched paged-decode call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def prepare_inputs(step: StepMessage, block_size: int, device: torch.device) -> ModelInputs:
    ordered = step.seqs
    num_decodes = sum(1 for s in ordered if s.num_tokens == 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens_q = [0]
    context_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[SeqStep] = []
    for s in ordered:
        input_ids.extend(s.token_ids)
        table = s.block_table
        for pos in range(s.start_pos, s.context_len):
            positions.append(pos)
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        cu_seqlens_q.append(cu_seqlens_q[-1] + s.num_tokens)
        context_lens.append(s.context_len)
        if s.do_sample:
            # the last known token's row and one per draft: (1 + len(drafts)) rows, in order
            logits_indices.extend(range(cu_seqlens_q[-1] - s.num_sampled, cu_seqlens_q[-1]))
            sampled.append(s)
    max_blocks = max(len(s.block_table) for s in ordered)
    block_tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in ordered]

    def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        # Built on the host, copied once; pinned + non_blocking would overlap on GPU.
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=as_tensor(slot_mapping, torch.int64),
        block_tables=as_tensor(block_tables, torch.int32),
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
    )
