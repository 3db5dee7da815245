"""LoRA slots on the model's projections, and the per-step token -> slot mapping.

Every target projection (qkv, o, gate_up, down) gets `max_loras` slots of stacked buffers:

    A: (max_loras, num_shards * max_rank, in)     B: (max_loras, out, num_shards * max_rank)

A merged projection (q, k and v in one GEMM) stacks its shards' A matrices along the rank axis
and lays their B matrices block-diagonally (shard s's rows x shard s's rank columns), with the
adapter's scaling folded into B, so one slot's delta for any subset of targets is two matmuls:
out += (x @ A[s].T) @ B[s].T. A smaller rank or a missing target is zero-padding.

A step runs the base GEMM once for the whole batch (whatever the weight method: float,
FP8, INT8) and then, per adapter present in the step, that low-rank update on its tokens'
rows (a grouped torch path on every device; no fused Triton kernel yet). The mapping is set
for the duration of one forward, as the attention metadata is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from stoker.lora.adapter import LoRAAdapter


@dataclass(frozen=True)
class LoRAMapping:
    # (slot, row indices of the step's tokens that use it; None: every token)
    groups: tuple[tuple[int, torch.Tensor | None], ...]


_mapping: LoRAMapping | None = None


@contextmanager
def lora_mapping(mapping: LoRAMapping | None):
    global _mapping
    previous, _mapping = _mapping, mapping
    try:
        yield
    finally:
        _mapping = previous


class LoRASlots:
    """The slots of one projection. shards: [(checkpoint module name, first output row, rows)]."""

    def __init__(self, layer_idx: int, shards: list[tuple[str, int, int]], in_features: int, out_features: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layer_idx = layer_idx
        self.shards = shards
        self.max_rank = max_rank
        ranks = len(shards) * max_rank
        self.A = torch.zeros(max_loras, ranks, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(max_loras, out_features, ranks, dtype=dtype, device=device)
        self.active = [False] * max_loras  # a slot whose adapter targets none of these shards adds nothing

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.active[slot] = False
        for k, (module, first_row, rows) in enumerate(self.shards):
            ab = adapter.weights.get((self.layer_idx, module))
            if ab is None:
                continue
            a, b = ab  # (r, in), (out_rows, r)
            cols = slice(k * self.max_rank, k * self.max_rank + adapter.rank)
            self.A[slot, cols] = a.to(self.A.dtype)
            self.B[slot, first_row:first_row + rows, cols] = (b * adapter.scaling).to(self.B.dtype)
            self.active[slot] = True

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.active[slot] = False

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x: (T, in), out: (T, out) the base projection's output; adds each slot's update."""
        mapping = _mapping
        if mapping is None:
            return out
        for slot, rows in mapping.groups:
            if not self.active[slot]:
                continue
            a, b = self.A[slot], self.B[slot]
            if rows is None:
                out = out + (x @ a.T) @ b.T
            else:
                out = out.index_add(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return out
