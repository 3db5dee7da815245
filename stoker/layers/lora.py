"""LoRA on a projection: its slots, the per-step map of tokens to slots, and the wrapper method.

A LoRA projection keeps its weight method (float, FP8, INT8: the base GEMM runs once for the
whole batch whatever it is) wrapped in a `LoRAMethod`, whose `apply` adds each token's adapter
update when the forward's context maps some tokens to a slot (layers/forward_context.py). The
model walk that puts slots on the target projections is the runner's (runner/lora.py).

Every target projection (qkv, o, gate_up, down) holds `max_loras` slots (S) of rank up to
`max_rank` (R) for each of its shards (num_shards: q, k, v; gate, up; or 1 for a whole layer),
W = num_shards * R:

    A: (S, W, in)     one slot's shards stacked along the rank axis
    BT: (S, W, out)   one slot's expand, transposed: shard k's R rows reach only shard k's
                      output columns (zero elsewhere), the adapter's scaling folded in

The step's sequences are grouped by slot (core/step.build_step orders decodes, then prefills,
each by slot), so each adapter's tokens are one or two contiguous runs ("segments"), and per
segment (slot s, tokens t0:t1) the update is

    out[t0:t1] += (x[t0:t1] @ A[s].T) @ BT[s]

a token paying for its own adapter only, each slot's weights read once per step, the base GEMM
run once for the whole batch whatever its weight method. On CPU float32 one C call per
projection does every segment (kernels/cpu/lora.c: it skips BT's zero blocks and the rows
past each adapter's rank); elsewhere on CPU its torch twin (two GEMMs per segment). On CUDA the
Triton kernel (kernels/lora_bgmv.py) reads each token's slot through `slot_ids` over views of
the same buffers. Earlier CPU paths measured slower (docs/benchmarks.md, "Multi-LoRA on CPU"):
every slot for every token then a mask (0.74 of base), a gather/scatter per adapter in the
step's arrival order (0.23), and these segments as torch ops (0.71: ~10 us of dispatch per tiny
GEMM, two per segment per projection).

A fused [gate; up] CPU layer (its kernel writes silu(gate) * up in one pass) takes its update
before the activation: the layer asks the kernel for the pre-activation, whose columns come
in panel order (`out_rows`), and BT's columns follow that order. A smaller rank or a missing
target is zero-padding. The mapping is set for one forward, as the attention metadata is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stoker.kernels import reference
from stoker.layers.forward_context import get_forward_context
from stoker.layers.weight_method import LinearMethod
from stoker.lora.adapter import LoRAAdapter

if TYPE_CHECKING:
    from stoker.layers.linear import Linear


@dataclass
class LoRAMapping:
    # (slot, first token, end token): maximal runs of the step's tokens on one adapter (base: none)
    segments: list[tuple[int, int, int]]
    # (T,) int32 slot per token (-1: base), for the GPU kernel
    slot_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.segments_tensor = torch.tensor(self.segments, dtype=torch.int64).reshape(-1, 3)  # for the C kernel


def segments_of(slot_per_seq: list[int], cu_seqlens: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive sequences on the same slot >= 0, as (slot, t0, t1) token spans."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slot_per_seq):
        if slot < 0 or cu_seqlens[i] == cu_seqlens[i + 1]:
            continue
        if runs and runs[-1][0] == slot and runs[-1][2] == cu_seqlens[i]:
            runs[-1] = (slot, runs[-1][1], cu_seqlens[i + 1])
        else:
            runs.append((slot, cu_seqlens[i], cu_seqlens[i + 1]))
    return runs


class LoRASlots:
    """The slots of one projection. shards: [(checkpoint module name, first local output row, local
    rows, the rows of the adapter's B this rank holds)]; in_cols: the columns of A it holds (all
    but for a row-parallel layer under tensor parallelism).
    out_rows: (N,) the logical output row of each column the base kernel writes, when that is not
    the identity (a fused [gate; up] CPU layer's panel order)."""

    def __init__(self, layer_idx: int, shards: list[tuple[str, int, int, slice]], in_features: int,
                 out_features: int, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 out_rows: torch.Tensor | None = None, in_cols: slice = slice(None)) -> None:
        from stoker.kernels.cpu import build as cpu_kernels

        self.layer_idx = layer_idx
        self.shards = shards
        self.in_cols = in_cols
        self.max_loras = max_loras
        self.max_rank = max_rank
        width = len(shards) * max_rank
        self.A = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.BT = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        self.out_rows = None if out_rows is None else out_rows.to(device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)  # the rank of the adapter in each slot (0: empty)
        # The nonzero blocks of BT, for the C kernel: shard k's R rank rows (of which the slot's
        # adapter fills the first `rank`) reach its columns only (in panel order gate and up
        # columns interleave: each shard's rows then span all of them).
        r = max_rank
        self.blocks = torch.tensor([(k * r, (k + 1) * r, *((0, out_features) if self.out_rows is not None else
                                                           (first, first + rows)))
                                    for k, (_, first, rows, _) in enumerate(shards)], dtype=torch.int64)
        # The CPU path, chosen once: the C kernel on float32, else its torch twin.
        self.use_c_kernel = device.type == "cpu" and dtype == torch.float32 and cpu_kernels.available()

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.clear(slot)
        r = self.max_rank
        logical = torch.zeros_like(self.BT[slot])  # (W, N), columns in [q; k; v] / [gate; up] order
        for k, (module, first, rows, b_rows) in enumerate(self.shards):
            ab = adapter.weights.get((self.layer_idx, module))
            if ab is None:
                continue
            a, b = ab  # the whole (rank, in), (rows, rank): this rank's part of each
            self.A[slot, k * r:k * r + adapter.rank] = a[:, self.in_cols].to(self.A.dtype)
            logical[k * r:k * r + adapter.rank, first:first + rows] = (b[b_rows] * adapter.scaling).T.to(logical.dtype)
        self.BT[slot] = logical if self.out_rows is None else logical[:, self.out_rows]
        self.ranks[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.BT[slot].zero_()
        self.ranks[slot] = 0

    def apply(self, x: torch.Tensor, out: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """x: (T, in), out: (T, out) the base projection's output; adds each token's adapter update."""
        if x.is_cuda and mapping.slot_ids is not None:
            return self._apply_bgmv(x, out, mapping.slot_ids)
        if self.use_c_kernel:
            from stoker.kernels.cpu import lora as cpu_lora

            return cpu_lora.lora(x, self.A, self.BT, mapping.segments_tensor, self.blocks, self.ranks, out)
        return reference.lora_segments(x, self.A, self.BT, mapping.segments, out)

    def _apply_bgmv(self, x: torch.Tensor, out: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """GPU: the Triton kernel (kernels/lora_bgmv.py) reads each token's own slot only."""
        from stoker.kernels.lora_bgmv import lora_bgmv

        if self.out_rows is not None:
            raise RuntimeError("a panel-ordered (fused CPU) projection has no GPU LoRA path")
        r = self.max_rank
        out = out.contiguous()
        for k, (_, first, rows, _) in enumerate(self.shards):
            a = self.A[:, k * r:(k + 1) * r]  # (S, R, in), slot stride W * in
            b = self.BT[:, k * r:(k + 1) * r, first:first + rows].transpose(1, 2)  # (S, rows, R) view
            lora_bgmv(x.contiguous(), a, b, slot_ids, out, first)
        return out


class LoRAMethod(LinearMethod):
    """A projection's weight method with LoRA slots on top: the base method creates, loads and
    applies the weight; `apply` adds the adapters' updates of the step's mapped tokens.

    A base that fuses SiLU-and-mul into a [gate; up] GEMM (CPU panels) takes the update before
    the activation: its pre-activation (panel order), the update in that order, then the
    activation as the fused kernel would have applied it. Which path is chosen here, once."""

    def __init__(self, base: LinearMethod, slots: LoRASlots) -> None:
        self.base = base
        self.slots = slots
        self.kind = base.kind
        self.fuse_silu_and_mul = base.fuse_silu_and_mul
        self._apply_mapped = self._apply_before_activation if base.fuse_silu_and_mul else self._apply_after

    # The weight itself is the base method's.
    def checkpoint_params(self, layer: Linear) -> tuple[str, ...]:
        return self.base.checkpoint_params(layer)

    def create_weights(self, layer: Linear) -> None:
        self.base.create_weights(layer)

    def checkpoint_slice(self, layer: Linear, param_name: str, shard: str | None,
                         shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return self.base.checkpoint_slice(layer, param_name, shard, shape)

    def load(self, layer: Linear, param_name: str, shard: str | None, tensor: torch.Tensor) -> None:
        self.base.load(layer, param_name, shard, tensor)

    def process_after_loading(self, layer: Linear) -> None:
        self.base.process_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        mapping = get_forward_context().lora_mapping
        if mapping is None:  # no token of this step is on an adapter
            return self.base.apply(layer, x)
        return self._apply_mapped(layer, x, mapping)

    def _apply_after(self, layer: Linear, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        return self.slots.apply(x, self.base.apply(layer, x), mapping)

    def _apply_before_activation(self, layer: Linear, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        pre = self.base.apply_pre_activation(layer, x)  # (T, 2I) in the kernel's panel order
        return self.base.activate(self.slots.apply(x, pre, mapping))  # (T, I)

    def describe(self) -> str:
        return f"{self.base.describe()}+LoRA"
