"""LoRA slots on the model's projections, and the per-step token -> slot mask.

Every target projection (qkv, o, gate_up, down) holds `max_loras` slots (S) of rank up to
`max_rank` (R) for each of its shards (q, k, v; gate, up; or the whole layer):

    A: (num_shards * S * R, in)          every shard's and slot's A stacked along the rank axis
    B[k]: (rows of shard k, S * R)       shard k's B matrices side by side, scaling folded in

One step, whatever adapters its tokens use, is then a fixed handful of ops per projection:

    xa = x @ A.T                         (T, num_shards * S * R): every token against every slot
    xa *= mask                           keep, per token, only its own slot's R columns
    out[:, shard k] += xa[:, k] @ B[k].T per shard

The base GEMM runs once for the whole batch (whatever the weight method: float, FP8, INT8);
the extra work is the low-rank product for all S slots (a token's other slots are masked out),
which costs S x R x (in + out) per token and reads every slot's A and B once per step. With a
handful of slots of rank 8-64 that is a few percent of the base layer's bytes on real model
sizes, and the op count does not grow with the number of adapters in the step (the grouped
alternative, one gather/matmul/scatter per adapter per projection, ran at 0.23 of base throughput
against this path's 0.74 on CPU: docs/benchmarks.md, "Multi-LoRA on CPU").
A smaller rank or a missing target is zero-padding. The mask is set for one forward, as the
attention metadata is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from stoker.lora.adapter import LoRAAdapter


@dataclass
class LoRAMapping:
    mask: torch.Tensor  # (T, S * R): 1 in the R columns of each token's slot, 0 elsewhere (all 0: base)
    # (T,) int32 slot per token (-1: base), for the GPU kernel that reads only each token's slot
    slot_ids: torch.Tensor | None = None
    _tiled: dict[int, torch.Tensor] = field(default_factory=dict)

    def tiled(self, num_shards: int) -> torch.Tensor:
        """(T, num_shards * S * R): the mask repeated once per shard (made once per step)."""
        if num_shards == 1:
            return self.mask
        if num_shards not in self._tiled:
            self._tiled[num_shards] = self.mask.repeat(1, num_shards)
        return self._tiled[num_shards]


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
        self.max_loras = max_loras
        self.max_rank = max_rank
        width = max_loras * max_rank
        self.A = torch.zeros(len(shards) * width, in_features, dtype=dtype, device=device)
        self.B = [torch.zeros(rows, width, dtype=dtype, device=device) for _, _, rows in shards]

    def _cols(self, k: int, slot: int) -> slice:
        """Shard k's rank columns of `slot` in A's rows (and, minus k's offset, in B[k]'s columns)."""
        start = (k * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.clear(slot)
        for k, (module, _, _) in enumerate(self.shards):
            ab = adapter.weights.get((self.layer_idx, module))
            if ab is None:
                continue
            a, b = ab  # (r, in), (rows, r)
            rows = self._cols(k, slot)
            self.A[rows.start:rows.start + adapter.rank] = a.to(self.A.dtype)
            first = slot * self.max_rank
            self.B[k][:, first:first + adapter.rank] = (b * adapter.scaling).to(self.B[k].dtype)

    def clear(self, slot: int) -> None:
        for k in range(len(self.shards)):
            self.A[self._cols(k, slot)].zero_()
            self.B[k][:, slot * self.max_rank:(slot + 1) * self.max_rank].zero_()

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x: (T, in), out: (T, out) the base projection's output; adds each token's adapter update."""
        mapping = _mapping
        if mapping is None:
            return out
        if x.is_cuda and mapping.slot_ids is not None:
            return self._apply_bgmv(x, out, mapping.slot_ids)
        xa = x @ self.A.T  # (T, num_shards * S * R)
        xa.mul_(mapping.tiled(len(self.shards)))
        width = self.max_loras * self.max_rank
        for k, (_, first, rows) in enumerate(self.shards):
            part = xa[:, k * width:(k + 1) * width]
            if len(self.shards) == 1:
                out = out.addmm(part, self.B[k].T)
            else:
                out[:, first:first + rows].addmm_(part, self.B[k].T)
        return out

    def _apply_bgmv(self, x: torch.Tensor, out: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """GPU: the Triton kernel (kernels/lora_bgmv.py) reads each token's own slot only."""
        from stoker.kernels.lora_bgmv import lora_bgmv

        num_shards, s, r = len(self.shards), self.max_loras, self.max_rank
        a = self.A.view(num_shards, s, r, -1)
        out = out.contiguous()
        for k, (_, first, rows) in enumerate(self.shards):
            b = self.B[k].view(rows, s, r).permute(1, 0, 2)  # (S, rows, R) over the (rows, S, R) buffer
            lora_bgmv(x.contiguous(), a[k], b, slot_ids, out, first)
        return out
