"""Linear layers whose weights may be stacked from several checkpoint tensors.

q/k/v projections (and gate/up) run as one GEMM each: fewer, larger matrix multiplies
read the activations once. The checkpoint keeps them separate, so each merged layer knows
where each named shard goes (`load_shard`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One weight (sum(out_sizes), in) holding named shards stacked along the output dim."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        param = getattr(self, param_name)
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shard {shard!r} of {param_name}: checkpoint shape {tuple(tensor.shape)}, expected {expected}")
        with torch.no_grad():
            param[offset : offset + size].copy_(tensor)


def use_column_major_weights(model: nn.Module) -> int:
    """Re-lay every projection weight column-major for CPU GEMMs; returns how many changed.

    The weight keeps its (out, in) shape (loading, shards and the twins see no difference),
    but its memory becomes (in, out) row-major, so `F.linear` hands MKL a non-transposed B.
    `benchmarks/cpu_kernels.py`: 1.9x at M = 8 and 1.4x at M = 32 for in 512 / out 2816,
    mixed for in 1408 / out 512, equal at M = 1 and prefill sizes; decode GEMMs over a whole
    run ~12% faster. Same memory, one layer copied at a time.
    A weight shared with the token embedding (tied LM head) is left alone: the embedding
    looks rows up, which wants them contiguous.
    """
    from stoker.layers.embedding import LMHead, VocabEmbedding

    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding)}
    changed = 0
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)) and id(module.weight) not in embedding_weights:
            w = module.weight.data
            if w.dim() == 2 and w.is_contiguous():
                module.weight.data = w.t().contiguous().t()
                changed += 1
    return changed
