"""Quantized number formats: quantize, dequantize, unpack, and scales brought to one shape.

Every quantized projection is held as `qweight` (N, K) in int8 or float8_e4m3fn and `scale`
(N, G) float32, one scale per output row and group of `group_k` columns of K (G = ceil(K /
group_k); per-channel and per-tensor schemes have G = 1, group_k = K). The dequantized weight
is `qweight.float() * scale` expanded over each group: the one definition every kernel and
twin computes. Checkpoint scales of every strategy are brought to that shape by `scale_rows`.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
STORAGE_DTYPES = {"fp8": FP8_DTYPE, "int8": torch.int8}
# What a float checkpoint holds: what --quantization quantizes, and what an unquantized
# projection loads (an 8-bit tensor there would be cast without its scale).
FLOAT_CHECKPOINT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_rows(weight: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization: (N, K) float -> (qweight (N, K), scale (N, 1) float32).

    scale = max |w| of the row / the format's largest value, so each row uses the whole range
    (an all-zero row gets scale 1). int8 rounds to nearest; FP8 rounds as torch's cast does
    (to nearest even), after clamping, since the cast does not saturate.
    """
    w = weight.float()
    top = FP8_MAX if dtype == "fp8" else INT8_MAX
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    return quantize_with(w, scale, dtype), scale


def quantize_with(weight: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """weight / scale (broadcast) in the storage format, clamped to its range."""
    top = FP8_MAX if dtype == "fp8" else INT8_MAX
    scaled = (weight.float() / scale).clamp(-top, top)
    if dtype == "fp8":
        return scaled.to(FP8_DTYPE)
    return scaled.round().to(torch.int8)


def expand_groups(scale: torch.Tensor, group_k: int, in_features: int) -> torch.Tensor:
    """(N, G) per-group scales -> (N, K), each repeated over its group's columns."""
    if scale.shape[1] == 1:
        return scale.expand(-1, in_features)
    return scale.repeat_interleave(group_k, dim=1)[:, :in_features]


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, group_k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) quantized + (N, G) scales -> the (N, K) weight they stand for, in `dtype`."""
    return (qweight.float() * expand_groups(scale.float(), group_k, qweight.shape[1])).to(dtype)


def unpack_int32(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """compressed-tensors pack-quantized, 8 bits: (N, ceil(K / 4)) int32 -> (N, K) int8.

    Each int32 holds four values, the first in the lowest byte, each stored as value + 128
    (unsigned); the row is zero-padded to a multiple of four.
    """
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"weight_packed must be a 2-D int32 tensor, got {tuple(packed.shape)} {packed.dtype}")
    as_bytes = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)  # little-endian: lowest byte first
    if as_bytes.shape[1] < in_features:
        raise ValueError(f"weight_packed holds {as_bytes.shape[1]} values per row, the layer needs {in_features}")
    return (as_bytes[:, :in_features].to(torch.int16) - 128).to(torch.int8)


def pack_int32(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_int32` (used to write test checkpoints as llm-compressor does)."""
    n, k = qweight.shape
    padded = torch.zeros(n, -(-k // 4) * 4, dtype=torch.uint8)
    padded[:, :k] = (qweight.to(torch.int16) + 128).to(torch.uint8)
    return padded.view(torch.int32)


def scale_rows(
    tensor: torch.Tensor, strategy: str, rows: int, in_features: int, group_size: int | None, block: tuple[int, int] | None
) -> tuple[torch.Tensor, int]:
    """A checkpoint scale tensor for `rows` output rows -> ((rows, G) float32, group_k).

    tensor: per-tensor () / (1,) / (1, 1); per-channel (rows,) / (rows, 1); per-group
    (rows, ceil(K / group_size)); per-block (ceil(rows / bn), ceil(K / bk)) with (bn, bk) = block.
    """
    t = tensor.float()
    if strategy == "tensor":
        if t.numel() != 1:
            raise ValueError(f"a per-tensor scale must hold one value, got shape {tuple(tensor.shape)}")
        return t.reshape(1, 1).expand(rows, 1).contiguous(), in_features
    if strategy == "channel":
        if t.numel() != rows:
            raise ValueError(f"a per-channel scale must hold {rows} values, got shape {tuple(tensor.shape)}")
        return t.reshape(rows, 1).contiguous(), in_features
    if strategy == "group":
        assert group_size is not None
        groups = -(-in_features // group_size)
        if tuple(t.shape) != (rows, groups):
            raise ValueError(f"per-group scales must be ({rows}, {groups}) for group_size {group_size}, got {tuple(tensor.shape)}")
        return t.contiguous(), group_size
    assert block is not None
    bn, bk = block
    expected = (-(-rows // bn), -(-in_features // bk))
    if tuple(t.shape) != expected:
        raise ValueError(f"block scales must be {expected} for {rows} x {in_features} in blocks of {bn} x {bk}, got {tuple(tensor.shape)}")
    return t.repeat_interleave(bn, dim=0)[:rows].contiguous(), bk


# ---------------------------------------------------------------- MXFP4 (OCP Microscaling)
# gpt-oss's expert weights: FP4 E2M1 values, two to a byte (the even element in the low nibble,
# the odd one in the high), 32 to a block sharing one E8M0 scale (an exponent, bias 127):
#     blocks (..., G, 16) uint8, scales (..., G) uint8 -> (..., G * 32) = E2M1[nibble] * 2^(scale - 127)
# (the OCP Microscaling spec v1.0; transformers' integrations/mxfp4.py reads the Hub's files so).
MXFP4_BLOCK = 32
MXFP4_BYTES_PER_BLOCK = MXFP4_BLOCK // 2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., G, 16) uint8 + scales (..., G) uint8 -> (..., G * 32) in `dtype`: each value
    from the 16-entry E2M1 table, times 2^(scale - 127) (exact: a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BYTES_PER_BLOCK:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected (..., G, "
                         f"{MXFP4_BYTES_PER_BLOCK}) and (..., G)")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    values = values.reshape(*scales.shape, MXFP4_BLOCK)  # (..., G, 32): low nibble first
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents[..., None]).reshape(*scales.shape[:-1], -1).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) float, K a multiple of 32 -> (blocks (..., K / 32, 16), scales (..., K / 32)) uint8:
    per block the OCP spec's scale 2^(floor(log2(amax)) - 2) (E2M1's largest exponent is 2;
    the block's largest value lands in [4, 8) and saturates at 6), each value rounded to the
    nearest E2M1 value (a tie to the smaller magnitude)."""
    w = weight.float()
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of whole 32-element blocks; the last dimension is {w.shape[-1]}")
    w = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)  # (..., G, 32)
    amax = w.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2, torch.zeros_like(amax))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = (w / torch.exp2(exponent)[..., None]).clamp(-6.0, 6.0)
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    codes = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # nearest magnitude (a tie: the smaller)
    codes = codes | ((scaled < 0).long() << 3)
    codes = codes.reshape(*codes.shape[:-1], MXFP4_BYTES_PER_BLOCK, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return blocks, (exponent + E8M0_BIAS).to(torch.uint8)
