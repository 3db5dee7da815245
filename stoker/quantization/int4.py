"""4-bit weights: the one affine group representation every 4-bit format is brought to.

    w[n, k] = q[n, k] * scale[n, k // group_size] + offset[n, k // group_size]

q (N, K) uint8 in [0, 15]; scale and offset (N, G) float32, G = K / group_size (K must be a
multiple of the group: a short last group is refused, naming the sizes). Symmetric int4 is
the case offset = -8 * scale (q - 8 in [-8, 7]); an asymmetric format with zero point z has
offset = -z * scale, and one with a minimum m (GGUF Q4_K) has offset = -m. `dequantize`
computes q * scale, rounded, then + offset, rounded (two float32 roundings, never fused):
the definition the dequantizing twins follow. The CPU kernel (kernels/cpu/linear_q4.h) never
forms w: it sums x * (q - 8) per group and applies scale and o + 8 * scale once per group, the
same product to float32 rounding, the same bits on every FMA build.

Entry point for loaders whose format decodes to this form (GGUF Q4_0 / Q4_K, AWQ, GPTQ):
build an `AffineInt4` of one checkpoint tensor (one shard of a merged layer, whole: the rows
and columns of the checkpoint, not of this rank) and hand it to the projection's method:

    layer.method.load_affine(layer, shard, AffineInt4(q, scale, offset, group_size))

(layers/int4_method.Int4LinearMethod.load_affine). The method takes this tensor-parallel
rank's rows and columns itself, cut at group boundaries, and refuses a cut that splits a group.
A method that does not hold 4-bit weights has no `load_affine`: `load_affine` below says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

QMAX = 15  # unsigned 4-bit codes: [0, 15]
SYMMETRIC_ZERO = 8  # symmetric int4: q - 8 in [-8, 7]
GROUP_SIZES = (32, 64, 128)  # the common ones; any positive size dividing K works


def num_groups(in_features: int, group_size: int, where: str = "weight") -> int:
    """G = K / group_size; a K that is not a multiple of the group is refused, naming both."""
    if group_size <= 0:
        raise ValueError(f"{where}: int4 group_size must be positive, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"{where}: {in_features} input columns are not a multiple of the int4 group size "
                         f"{group_size}; choose a group size that divides {in_features}")
    return in_features // group_size


def quantize(weight: torch.Tensor, group_size: int, symmetric: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: (N, K) float -> (q (N, K) uint8, scale (N, G), offset (N, G) float32).

    symmetric: scale = max |w| of the group / 7, rounded to the nearest float16 when it is a
    normal float16 (then every scale of the layer may be held in 16 bits, Q4_0's 4.5 bits a
    weight: kernels/cpu/linear_q4.pack_q4_scales), q = round(w / scale) + 8 in
    [0, 15], offset = -8 * scale. asymmetric: scale = (max - min) / 15,
    offset = min, q = round((w - min) / scale). An all-zero group gets scale 1 (and stays 0).
    """
    n, k = weight.shape
    g = num_groups(k, group_size)
    w = weight.float().reshape(n, g, group_size)
    if symmetric:
        amax = w.abs().amax(dim=2)
        scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
        normal16 = (scale >= 2.0**-14) & (scale <= 65504.0)
        scale = torch.where(normal16, scale.half().float(), scale)
        q = (w / scale.unsqueeze(2)).round().clamp(-SYMMETRIC_ZERO, QMAX - SYMMETRIC_ZERO) + SYMMETRIC_ZERO
        offset = -SYMMETRIC_ZERO * scale
    else:
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        span = hi - lo
        scale = torch.where(span > 0, span / QMAX, torch.ones_like(span))
        offset = lo
        q = ((w - lo.unsqueeze(2)) / scale.unsqueeze(2)).round().clamp(0, QMAX)
    return q.to(torch.uint8).reshape(n, k), scale.contiguous(), offset.contiguous()


def expand(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, G) per-group values -> (N, G * group_size), each repeated over its group's columns."""
    return groups.float().repeat_interleave(group_size, dim=1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (N, K) weight that (q, scale, offset) stand for: q * scale, rounded, + offset, rounded."""
    product = q.float() * expand(scale, group_size)
    return (product + expand(offset, group_size)).to(dtype)


def pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K / 2) uint8, two per byte: even k in the low nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"packing 4-bit codes needs an even number of columns, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: (N, K / 2) uint8 -> (N, K) codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@dataclass(frozen=True)
class AffineInt4:
    """One checkpoint tensor in the affine form: q (N, K) uint8 in [0, 15], scale and offset
    (N, K / group_size) float32. `check` verifies the shapes, dtypes and range (a loader's
    decoding bug is caught here, not as wrong logits)."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int

    def check(self, where: str = "weight") -> None:
        if self.q.dim() != 2 or self.q.dtype != torch.uint8:
            raise ValueError(f"{where}: int4 codes must be a 2-D uint8 tensor, got {tuple(self.q.shape)} {self.q.dtype}")
        n, k = self.q.shape
        g = num_groups(k, self.group_size, where)
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if tuple(t.shape) != (n, g):
                raise ValueError(f"{where}: int4 {name} must be ({n}, {g}) for {k} columns in groups of "
                                 f"{self.group_size}, got {tuple(t.shape)}")
        if self.q.numel() and int(self.q.max()) > QMAX:
            raise ValueError(f"{where}: int4 codes must be in [0, {QMAX}], found {int(self.q.max())}")

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.offset, self.group_size)

    @staticmethod
    def from_symmetric(q_signed: torch.Tensor, scale: torch.Tensor, group_size: int) -> AffineInt4:
        """Signed codes in [-8, 7] with one scale per group (w = q * scale) -> the affine form."""
        s = scale.float().contiguous()
        return AffineInt4((q_signed.to(torch.int16) + SYMMETRIC_ZERO).to(torch.uint8), s, -SYMMETRIC_ZERO * s, group_size)

    @staticmethod
    def from_zero_point(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> AffineInt4:
        """Unsigned codes in [0, 15] with a zero point per group (w = (q - z) * scale)."""
        s = scale.float().contiguous()
        return AffineInt4(q.to(torch.uint8), s, (-zero.float() * s).contiguous(), group_size)


def load_affine(layer: Any, shard: str | None, weight: AffineInt4) -> None:
    """Hand one checkpoint tensor in the affine form to `layer`'s method (a loader's entry
    point); a projection whose method does not hold 4-bit weights is refused by name."""
    method = getattr(layer.method, "base", layer.method)
    if not hasattr(method, "load_affine"):
        raise ValueError(f"this projection runs {method.describe()}, not int4: a 4-bit checkpoint tensor needs the "
                         "int4 weight method (the checkpoint's quantization config, or --quantization int4)")
    method.load_affine(layer, shard, weight)
