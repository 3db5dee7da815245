"""Linear layers whose weights may be stacked from several checkpoint tensors.

q/k/v projections (and gate/up) run as one GEMM each: fewer, larger matrix multiplies
read the activations once. The checkpoint keeps them separate, so each merged layer knows
where each named shard goes (`load_shard`).

On CPU the runner changes the weights' memory layout after loading (`pack_cpu_weights`,
else `use_column_major_weights`); `project` is the one forward both layouts share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stoker.kernels import ops


class PackableProjection:
    """Mixed into Linear and LMHead: `packed` is read off the weight itself, (out, in) as
    loaded or (P, in, NR) panels after pack_cpu_weights, so it cannot disagree with it."""

    weight: torch.Tensor

    @property
    def packed(self) -> bool:
        return self.weight.dim() == 3


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x (..., in) -> (..., out) for a Linear or LMHead, whichever layout its weight has."""
    if module.packed:  # weight (P, in, NR): kernels/cpu/native.pack_linear_weight
        return ops.linear_packed(x, module.weight, module.out_features, module.bias, module.fused_silu_and_mul)
    return F.linear(x, module.weight, module.bias)


class Linear(PackableProjection, nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # True once pack_cpu_weights has fused the MLP's SiLU-and-mul into this [gate; up]
        # projection: the output is then silu(gate) * up, half as wide.
        self.fused_silu_and_mul = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x)


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
        if self.packed:
            raise RuntimeError("weights are loaded before pack_cpu_weights, not after")
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
        if isinstance(module, (Linear, LMHead)) and not module.packed and id(module.weight) not in embedding_weights:
            w = module.weight.data
            if w.dim() == 2 and w.is_contiguous():
                module.weight.data = w.t().contiguous().t()
                changed += 1
    return changed


def pack_cpu_weights(model: nn.Module) -> int:
    """Replace every float32 projection weight by its panel layout for the C linear kernel
    (`kernels/cpu/linear.c`); returns how many changed. Call only when the CPU kernels are
    available: without them `project` still works, through a slow torch twin.

    The (out, in) weight becomes (ceil(out / NR), in, NR) panels (NR = 64 with AVX-512): the
    kernel then streams each panel once, contiguously. Same memory plus the padding of the
    last panel; one layer copied at a time. `benchmarks/cpu_kernels.py` compares it with MKL
    per batch size. A weight shared with the token embedding (tied LM head) is left alone:
    the embedding looks rows up, which wants them contiguous.
    An MLP whose activation is SiLU gets its [gate; up] projection packed with gate and up
    columns side by side in each panel, and the kernel applies silu(gate) * up before
    writing (the MLP then skips its activation: `fused_silu_and_mul`).
    """
    from stoker.kernels.cpu import native
    from stoker.layers.activation import SiluAndMul
    from stoker.layers.embedding import LMHead, VocabEmbedding

    fused = {
        id(m.gate_up_proj)
        for m in model.modules()
        if isinstance(getattr(m, "gate_up_proj", None), MergedLinear)
        and list(m.gate_up_proj.shard_offsets) == ["gate", "up"]
        and isinstance(getattr(m, "act", None), SiluAndMul)
        and native.gate_up_fusable(m.gate_up_proj.out_features // 2)
    }
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding)}
    changed = 0
    for module in model.modules():
        if (
            isinstance(module, (Linear, LMHead))
            and not module.packed
            and id(module.weight) not in embedding_weights
            and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu"
        ):
            gate_up = id(module) in fused
            module.weight.data = native.pack_linear_weight(module.weight.data, gate_up=gate_up)
            if module.bias is not None:
                module.bias.data = native.pack_linear_weight(module.bias.data, gate_up=gate_up)
            module.fused_silu_and_mul = gate_up
            changed += 1
    return changed
