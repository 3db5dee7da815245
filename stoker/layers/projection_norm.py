"""RMSNorm over a whole attention projection (all heads of q, or all KV heads of k), as OLMo 2
normalises q and k before rotary: one mean of squares over num_heads x head_dim, not per head.

Under tensor parallelism a rank holds only its heads' columns, so the mean needs the other
ranks' sums: each rank sums the squares of its columns (T, 1) in float32, one all-reduce adds
them (T floats per projection per layer, instead of gathering the whole q and k), and each
rank scales its own columns with its slice of the weight. KV heads replicated over ranks
(fewer KV heads than ranks) are counted once: the reduced sum is divided by the number of
ranks that hold each head. The weight is held whole on every rank (num_heads x head_dim
floats), so the checkpoint tensor loads as it is.

With one rank it is the model's bound RMSNorm kernel over the whole width.
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.kernels import ops


class ProjectionRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, held: tuple[int, int], tp: TensorParallelGroup, replicas: int = 1) -> None:
        """width: the whole projection's columns; held: [start, stop) of them on this rank;
        replicas: how many ranks hold the same columns."""
        super().__init__()
        self.width, self.eps = width, eps
        self.start, self.stop = held
        self.tp, self.replicas = tp, replicas
        self.is_whole = (self.start, self.stop) == (0, width)
        self.weight = nn.Parameter(torch.ones(width))
        self.kernels: ops.Kernels = ops.TORCH  # the builder binds the device's set

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, stop - start) -> same
        if self.is_whole:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        sum_sq = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))  # (T, 1), every held column once per replica
        inv_rms = torch.rsqrt(sum_sq / (self.replicas * self.width) + self.eps)
        return (xf * inv_rms).to(x.dtype) * self.weight[self.start:self.stop]

    def extra_repr(self) -> str:
        return f"width={self.width}, held=[{self.start}, {self.stop}), eps={self.eps}"
