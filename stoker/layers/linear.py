"""Projections whose weight representation is their method's (layers/weight_method.py).

q/k/v projections (and gate/up) run as one GEMM each: fewer, larger matrix multiplies read
the activations once. The checkpoint keeps them separate, so a merged layer knows which rows
each named shard owns (`shard_rows`), and its method loads every checkpoint tensor of a shard
(weight, scales, bias) into those rows.

A layer is built knowing only its shapes; `attach` gives it its method once, when the model
is built, and the method creates its parameters.

Tensor parallelism (Megatron-LM) is a property of the layer's shape, given when it is built:
  * `out_split` (column-parallel; per shard for a merged layer): this rank holds its part of
    the output rows; q/k/v by head, gate/up by column, the LM head by vocabulary;
  * `in_split` (row-parallel: o_proj, down_proj): this rank holds its part of the input
    columns, its output is a partial sum, and `forward` all-reduces it after the method;
    the bias is added once, by rank 0's part (the other ranks load zeros for it).
`in_features` / `out_features` are this rank's; the checkpoint's are kept beside them, and
`checkpoint_rows(shard)` / `checkpoint_cols()` say which part of a checkpoint tensor this
rank reads (the loader reads only that part from the safetensors file). What a method's
other tensors (scales) need of the checkpoint, the method says (`checkpoint_slice`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import WHOLE, Partition
from stoker.layers.weight_method import LinearMethod
from stoker.lora.layers import lora_active


if TYPE_CHECKING:
    from stoker.lora.layers import LoRASlots


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        out_split: Partition = WHOLE,
        in_split: Partition = WHOLE,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        if not in_split.is_whole and tp is None:
            raise ValueError("a row-parallel projection needs its tensor-parallel group (for the all-reduce)")
        self.checkpoint_in_features, self.in_split = in_features, in_split
        self.in_features = in_split.size(in_features)
        self.has_bias = bias
        # shard (None: the whole layer) -> (rows in the checkpoint tensor, this rank's part of them)
        self.checkpoint_shards: dict[str | None, tuple[int, Partition]] = {None: (out_features, out_split)}
        self.out_features = out_split.size(out_features)
        self.shard_offsets: dict[str, tuple[int, int]] = {}  # MergedLinear: shard -> (first local row, local rows)
        self.reduce = tp if not in_split.is_whole else None
        self.method: LinearMethod | None = None
        self.lora: LoRASlots | None = None  # multi-LoRA: the adapters' slots (lora/layers.py)

    def attach(self, method: LinearMethod) -> None:
        """Give this layer its weight method; the method creates the parameters (build time)."""
        if self.method is not None:
            raise RuntimeError("a projection's weight method is chosen once, when the model is built")
        self.method = method
        method.create_weights(self)
        bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if self.has_bias else None
        self.register_parameter("bias", bias)

    def shard_rows(self, shard: str | None) -> slice:
        """This rank's rows of `shard` in the layer's parameters (all of them for None)."""
        if shard is None:
            return slice(0, self.out_features)
        offset, size = self.shard_offsets[shard]
        return slice(offset, offset + size)

    def checkpoint_rows(self, shard: str | None) -> slice:
        """The rows of `shard`'s checkpoint tensor this rank holds."""
        total, part = self.checkpoint_shards[shard]
        return slice(*part.range(total))

    def checkpoint_shape(self, shard: str | None) -> tuple[int, int]:
        """The whole (rows, columns) of `shard`'s checkpoint weight, whatever this rank holds."""
        return self.checkpoint_shards[shard][0], self.checkpoint_in_features

    def checkpoint_cols(self) -> slice:
        """The columns (input features) of a checkpoint weight this rank holds."""
        return slice(*self.in_split.range(self.checkpoint_in_features))

    @property
    def is_split(self) -> bool:
        """Tensor-parallel: this rank holds a part of the checkpoint's rows or columns."""
        return not self.in_split.is_whole or any(not part.is_whole for _, part in self.checkpoint_shards.values())

    @property
    def is_padded(self) -> bool:
        """A vocabulary-parallel layer whose last part has fewer checkpoint rows than it holds."""
        return any(part.padded for _, part in self.checkpoint_shards.values())

    @property
    def fused_silu_and_mul(self) -> bool:
        """True when the method applies SiLU-and-mul itself (a [gate; up] layer's output is then
        silu(gate) * up, half as wide): the MLP skips its activation."""
        return bool(getattr(self.method, "fuse_silu_and_mul", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.method is None:
            raise RuntimeError("this projection has no weight method: build models with models.loader.build_model")
        if self.lora is not None and lora_active():
            out = self._forward_with_lora(x)
        else:
            out = self.method.apply(self, x)
        return out if self.reduce is None else self.reduce.all_reduce(out)

    def _forward_with_lora(self, x: torch.Tensor) -> torch.Tensor:
        """The base GEMM once for the whole batch, then each adapter's low-rank update on its tokens."""
        if not self.fused_silu_and_mul:
            return self.lora.apply(x, self.method.apply(self, x))
        # The update goes in before SiLU: the fused kernel's pre-activation (panel order), the
        # update in that order, then SiLU-and-mul as the fused kernel would have applied it.
        pre = self.method.apply_pre_activation(self, x)  # (T, 2I)
        return self.method.activate(self.lora.apply(x, pre))  # (T, I)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.has_bias}, method={self.method.describe() if self.method else None}"


class MergedLinear(Linear):
    """One projection of sum(shards.values()) output rows, the named shards stacked in order;
    with `out_splits`, each shard is cut between the ranks on its own (q by query head, k and
    v by KV head, which may be replicated), and this rank's parts are stacked."""

    def __init__(
        self, in_features: int, shards: dict[str, int], bias: bool = False, *, out_splits: dict[str, Partition] | None = None
    ) -> None:
        splits = out_splits or {}
        super().__init__(in_features, sum(shards.values()), bias)
        self.checkpoint_shards = {name: (size, splits.get(name, WHOLE)) for name, size in shards.items()}
        offset = 0
        for name, (size, part) in self.checkpoint_shards.items():
            local = part.size(size)
            self.shard_offsets[name] = (offset, local)
            offset += local
        self.out_features = offset
