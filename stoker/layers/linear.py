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

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import WHOLE, Partition
from stoker.layers.activation import SiluAndMul, get_gated_activation
from stoker.layers.weight_method import LinearMethod


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

    def attach(self, method: LinearMethod) -> None:
        """Give this layer its weight method; the method creates the parameters (build time)."""
        if self.method is not None:
            raise RuntimeError("a projection's weight method is chosen once, when the model is built")
        self.method = method
        method.create_weights(self)
        bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if self.has_bias else None
        self.register_parameter("bias", bias)

    def wrap_method(self, wrapper: LinearMethod) -> None:
        """Put a wrapper around the method after loading (LoRA: runner/lora.py); the wrapper
        keeps the base method's weights and representation (`wrapper.base`)."""
        assert getattr(wrapper, "base", None) is self.method, "a wrapper wraps the layer's own method"
        self.method = wrapper

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.method is None:
            raise RuntimeError("this projection has no weight method: build models with models.loader.build_model")
        out = self.method.apply(self, x)
        return out if self.reduce is None else self.reduce.all_reduce(out)

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


class GateUpLinear(MergedLinear):
    """An MLP's [gate; up] projection with its gated activation as the epilogue:
    (T, hidden) -> (T, intermediate) = act(x W_gate^T) * (x W_up^T).

    Gate and up run as one GEMM. A method that fuses SiLU-and-mul into that GEMM (the CPU
    panel kernels: `fuse_silu_and_mul`) writes the activated output itself, so the epilogue is
    then nothing; which one runs is decided when the method is attached, not per call."""

    def __init__(self, in_features: int, intermediate_size: int, hidden_act: str, bias: bool = False, *,
                 split: Partition = WHOLE) -> None:
        super().__init__(in_features, {"gate": intermediate_size, "up": intermediate_size}, bias,
                         out_splits={"gate": split, "up": split})
        self.act = get_gated_activation(hidden_act)  # (T, 2 * I) [gate | up] -> (T, I)
        self._epilogue: nn.Module | None = self.act

    @property
    def is_silu(self) -> bool:
        """SiLU-gated (what the fused CPU kernels can apply in the GEMM)."""
        return isinstance(self.act, SiluAndMul)

    def attach(self, method: LinearMethod) -> None:
        super().attach(method)
        self._epilogue = None if method.fuse_silu_and_mul else self.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., intermediate)
        out = super().forward(x)
        return out if self._epilogue is None else self._epilogue(out)
