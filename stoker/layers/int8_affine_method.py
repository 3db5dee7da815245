"""The affine 8-bit weight method: int8 codes with a scale and an offset per group of K.

    w[n, k] = q[n, k] * scale[n, g] + offset[n, g],   g = k // group_k

What GGUF's 5-bit affine types are exactly (quantization/gguf_blocks.py): Q5_K (codes 0..31,
scale d * sc and offset -(dmin * m) per 32-value sub-block) and Q5_1 (scale d, offset m per
block of 32). No 4-bit method holds 5-bit codes, and the symmetric int8 method
(layers/quantized_method.py, w = q * scale) has no offset: -offset / scale is not an integer
in general, so it cannot be folded into a code shift. The symmetric shards of a merged layer
(Q6_K, Q8_0, Q5_0: offset 0) sit in the same method when a sibling is affine, at the finest
group (the coarser scales and offsets repeated, exact).

Parameters: weight (N, K) int8, weight_scale and weight_offset (N, G) float32. Every product
q * scale is exact in float32 (5-bit codes times an fp16 x 6-bit scale), so `dequantize` here,
q * scale + offset with one rounding, is gguf-py's dequantize bit for bit (the GGUF tests).

The GEMM is the symmetric int8 kernel's plus the offsets' share, by linearity:

    x @ w^T = x @ (q * scale)^T + S(x) @ offset^T,   S(x)[m, g] = sum of x[m, k] over group g

so the C kernels run it without a new one (backend "cpu_q8": stoker_linear_q8 on one-byte panels,
then stoker_linear_f32 on the (N, G) offset panels, K / group_k columns: a 32nd of the GEMM);
"dequant" is the torch twin. On cpu_q8 both terms are computed row by row with a fixed
reduction order, so a row's output does not depend on the batch around it (batch-invariant,
as the C kernels are). The sum differs from x @ w^T on the dequantized weight only in float32
rounding order (within 1e-5 of it in the tests; logits within 1e-4 of HF's).

Loading: a loader decodes each checkpoint tensor whole into an `AffineInt8` and calls
`load_affine` (the GGUF loader's entry point, as for the int4 method); this rank's rows and its
columns, cut at group boundaries, are taken here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stoker.layers.linear import Linear
from stoker.layers.quantized_method import _aligned
from stoker.layers.weight_method import LinearMethod, copy_rows, expect_shape

BACKENDS = ("cpu_q8", "dequant")


@dataclass(frozen=True)
class AffineInt8:
    """One checkpoint tensor: q (N, K) int8, scale and offset (N, K / group_size) float32."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int

    def check(self, where: str) -> None:
        if self.q.dim() != 2 or self.q.dtype != torch.int8:
            raise ValueError(f"{where}: affine int8 codes must be a 2-D int8 tensor, got {tuple(self.q.shape)} {self.q.dtype}")
        n, k = self.q.shape
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"{where}: {k} columns are not whole groups of {self.group_size}")
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if tuple(t.shape) != (n, k // self.group_size) or t.dtype != torch.float32:
                raise ValueError(f"{where}: {name} must be ({n}, {k // self.group_size}) float32, got {tuple(t.shape)} {t.dtype}")

    def regroup(self, group_size: int, where: str) -> AffineInt8:
        """The same weight at a finer group (`group_size` dividing this one's): each scale and
        offset repeated, exact."""
        if group_size == self.group_size:
            return self
        if self.group_size % group_size:
            raise ValueError(f"{where}: groups of {self.group_size} cannot run at groups of {group_size}")
        r = self.group_size // group_size
        return AffineInt8(self.q, self.scale.repeat_interleave(r, dim=1), self.offset.repeat_interleave(r, dim=1), group_size)


def dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_k: int) -> torch.Tensor:
    """(N, K) float32: q * scale + offset per group (the product exact, one rounding)."""
    return q.float() * scale.repeat_interleave(group_k, dim=1) + offset.repeat_interleave(group_k, dim=1)


def group_sums(x: torch.Tensor, group_k: int) -> torch.Tensor:
    """(..., K) -> (..., K / group_k): each row's sum over each group of columns."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_k, group_k).sum(dim=-1)


class AffineInt8LinearMethod(LinearMethod):
    kind = "int8"

    def __init__(self, group_size: int, backend: str, name: str = "projection") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown affine int8 backend {backend!r}")
        self.group_k, self.backend, self.name = group_size, backend, name
        self.kernel = None
        self._forward = self._not_loaded

    def describe(self) -> str:
        return f"int8 group {self.group_k} affine via {self.backend}"

    def _not_loaded(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an affine int8 projection runs only after models.loader.load_weights")

    def checkpoint_params(self, layer: Linear) -> tuple[str, ...]:
        return ()  # a loader hands each tensor decoded (load_affine)

    def create_weights(self, layer: Linear) -> None:
        k, cols = layer.in_features, layer.checkpoint_cols()
        if k % self.group_k or cols.start % self.group_k:
            raise ValueError(f"{self.name}: {k} input columns (from column {cols.start}) are not whole groups of "
                             f"{self.group_k}; choose a tensor_parallel_size whose parts keep groups whole")
        n, g = layer.out_features, k // self.group_k
        layer.weight = nn.Parameter(torch.zeros(n, k, dtype=torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.zeros(n, g, dtype=torch.float32), requires_grad=False)
        layer.weight_offset = nn.Parameter(torch.zeros(n, g, dtype=torch.float32), requires_grad=False)

    def load(self, layer: Linear, param_name: str, shard: str | None, tensor: torch.Tensor) -> None:
        if param_name != "bias":
            raise ValueError(f"{self.name}: an affine int8 projection takes its weights decoded (load_affine), "
                             f"not checkpoint tensor {param_name!r}")
        copy_rows(layer, layer.bias, shard, tensor, "bias")

    def load_affine(self, layer: Linear, shard: str | None, weight: AffineInt8) -> None:
        """One whole checkpoint tensor of `shard`; this rank's rows and columns are cut here."""
        where = self.name + (f" (shard {shard!r})" if shard else "")
        weight.check(where)
        weight = weight.regroup(self.group_k, where)
        expect_shape(tuple(weight.q.shape), layer.checkpoint_shape(shard), where, None)
        rows, cols = layer.checkpoint_rows(shard), layer.checkpoint_cols()
        groups = _aligned(cols, self.group_k, f"groups of {self.group_k}", weight.q.shape[1])
        # a vocabulary-parallel LM head's last part may hold more rows than the checkpoint has left:
        # the rest stay zero (code 0, scale 0, offset 0)
        first = layer.shard_rows(shard).start
        local = slice(first, first + (rows.stop - rows.start))
        with torch.no_grad():
            layer.weight[local].copy_(weight.q[rows, cols])
            layer.weight_scale[local].copy_(weight.scale[rows, groups])
            layer.weight_offset[local].copy_(weight.offset[rows, groups])

    def process_after_loading(self, layer: Linear) -> None:
        if self.backend == "cpu_q8":
            from stoker.kernels.cpu import linear as cpu_linear

            layer.weight_scale = nn.Parameter(cpu_linear.pack_scales(layer.weight_scale.data, torch.int8), requires_grad=False)
            layer.weight_offset = nn.Parameter(cpu_linear.pack_linear_weight(layer.weight_offset.data), requires_grad=False)
            layer.weight = nn.Parameter(cpu_linear.pack_linear_weight(layer.weight.data), requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(cpu_linear.pack_linear_weight(layer.bias.data.float()), requires_grad=False)
            self._forward = self._cpu_q8
        else:
            self._forward = self._dequant

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self._forward(layer, x)

    def _cpu_q8(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from stoker.kernels.cpu import linear as cpu_linear

        n = layer.out_features
        codes = cpu_linear.linear_q8(x, layer.weight, layer.weight_scale, self.group_k, n, None)
        return codes + cpu_linear.linear(group_sums(x, self.group_k).contiguous(), layer.weight_offset, n, layer.bias)

    def _dequant(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        s = layer.weight_scale.repeat_interleave(self.group_k, dim=1)
        codes = torch.nn.functional.linear(x, (layer.weight.float() * s).to(x.dtype))
        offsets = torch.nn.functional.linear(group_sums(x, self.group_k), layer.weight_offset.to(x.dtype),
                                             None if layer.bias is None else layer.bias.to(x.dtype))
        return codes + offsets
