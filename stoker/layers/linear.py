"""Projections whose weight representation is their method's (layers/weight_method.py).

q/k/v projections (and gate/up) run as one GEMM each: fewer, larger matrix multiplies read
the activations once. The checkpoint keeps them separate, so a merged layer knows which rows
each named shard owns (`shard_rows`), and its method loads every checkpoint tensor of a shard
(weight, scales, bias) into those rows.

A layer is built knowing only its shapes; `attach` gives it its method once, when the model
is built, and the method creates its parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.layers.weight_method import LinearMethod


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = bias
        self.shard_offsets: dict[str, tuple[int, int]] = {}  # MergedLinear: shard -> (first row, rows)
        self.method: LinearMethod | None = None

    def attach(self, method: LinearMethod) -> None:
        """Give this layer its weight method; the method creates the parameters (build time)."""
        if self.method is not None:
            raise RuntimeError("a projection's weight method is chosen once, when the model is built")
        self.method = method
        method.create_weights(self)
        bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if self.has_bias else None
        self.register_parameter("bias", bias)

    def shard_rows(self, shard: str | None) -> slice:
        """The output rows of `shard` (all of them for None)."""
        if shard is None:
            return slice(0, self.out_features)
        offset, size = self.shard_offsets[shard]
        return slice(offset, offset + size)

    @property
    def fused_silu_and_mul(self) -> bool:
        """True when the method applies SiLU-and-mul itself (a [gate; up] layer's output is then
        silu(gate) * up, half as wide): the MLP skips its activation."""
        return bool(getattr(self.method, "fuse_silu_and_mul", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.method is None:
            raise RuntimeError("this projection has no weight method: build models with models.loader.build_model")
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.has_bias}, method={self.method.describe() if self.method else None}"


class MergedLinear(Linear):
    """One projection of sum(shards.values()) output rows, the named shards stacked in order."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
