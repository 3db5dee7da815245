"""GGUF (llama.cpp) block formats decoded exactly into Stoker's weight representations.

Each function takes one 2-D tensor's raw bytes, (N, K / block_size * block_bytes) uint8 as
GGUFReader maps them (one weight row per byte row, blocks along K), and returns what a Stoker
method holds, with no rounding anywhere (every product below is exact in float32):

  * 8-bit symmetric, `quantization/formats.py`'s form: `w = q * scale` per group of K,
      Q8_0  blocks of 32: fp16 d, 32 int8 q                 -> q int8, scale = d, group 32
      Q6_K  super-blocks of 256: 16 sub-blocks of 16 with an int8 sub-scale sc each, fp16 d,
            6-bit unsigned q stored as 4 low + 2 high bits  -> q - 32 int8, scale = d * sc, group 16
      Q5_0  blocks of 32: fp16 d, 32 high bits qh, 4-bit low q -> q - 16 int8, scale = d, group 32
  * 4-bit and 5-bit affine, `w = q * scale + offset`, q unsigned, per group of 32:
      Q4_0  blocks of 32: fp16 d, 4-bit q                    -> scale = d, offset = -8 d
      Q4_1  blocks of 32: fp16 d, m, 4-bit q                 -> scale = d, offset = m
      Q5_1  blocks of 32: fp16 d, m, qh, 4-bit low q: 5-bit q -> scale = d, offset = m
      Q4_K  super-blocks of 256: fp16 d, dmin, 8 sub-blocks of 32 with 6-bit sc, m packed in 12
            bytes, 4-bit q                                    -> scale = d * sc, offset = -(dmin * m)
      Q5_K  Q4_K's layout plus one high bit per value (32 bytes qh): 5-bit q, same scale/offset
Layouts as ggml-common.h defines them (block_q8_0, block_q4_0, block_q4_K, block_q5_K,
block_q6_K); `gguf.quants.dequantize` is the reference the tests compare with.
"""

from __future__ import annotations

import torch

QK = 32  # values per Q8_0 / Q4_0 block
QK_K = 256  # values per K-quant super-block
BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16, "Q5_0": 2 + 4 + 16, "Q5_1": 2 + 2 + 4 + 16, "Q4_K": 2 + 2 + 12 + 128, "Q5_K": 2 + 2 + 12 + 32 + 128, "Q6_K": 128 + 64 + 16 + 2}
BLOCK_VALUES = {"Q8_0": QK, "Q4_0": QK, "Q4_1": QK, "Q5_0": QK, "Q5_1": QK, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
# Columns of K per scale in the decoded form.
GROUP_K = {"Q8_0": 32, "Q6_K": 16, "Q5_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_1": 32, "Q4_K": 32, "Q5_K": 32}


def _blocks(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, int]:
    """(N, bytes) uint8 -> ((N, blocks, block_bytes) uint8, K)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"{kind} data must be (rows, bytes) uint8, got {tuple(raw.shape)} {raw.dtype}")
    size = BLOCK_BYTES[kind]
    if raw.shape[1] % size:
        raise ValueError(f"{kind} rows of {raw.shape[1]} bytes are not whole blocks of {size} bytes")
    nblocks = raw.shape[1] // size
    return raw.reshape(raw.shape[0], nblocks, size), nblocks * BLOCK_VALUES[kind]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian bytes -> (...) float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """(..., n * width) bytes -> (..., 2n, width): each run of `width` bytes gives its low
    nibbles, then its high nibbles (the order ggml's 4-bit formats store values in)."""
    runs = qs.reshape(*qs.shape[:-1], -1, 1, width)
    both = torch.cat([runs & 0x0F, runs >> 4], dim=-2)  # (..., n, 2, width)
    return both.reshape(*qs.shape[:-1], -1, width)


def q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q (N, K) int8, scale (N, K / 32) float32)."""
    b, k = _blocks(raw, "Q8_0")
    d = _f16(b[..., 0:2])  # (N, blocks)
    q = b[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], k)
    return q, d


def q6_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q (N, K) int8 in [-32, 31], scale (N, K / 16) float32 = d * sc)."""
    b, k = _blocks(raw, "Q6_K")
    n, nb = b.shape[:2]
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # (N, nb, 16)
    d = _f16(b[..., 208:210])  # (N, nb)
    # Two halves of 128 values; in each, value j < 64 takes ql[j]'s low nibble, 64 + j its high
    # nibble; the high bits come from qh[j % 32] shifted by 2 * (j // 32).
    low = _nibbles(ql.reshape(n, nb, 2, 64), 64).reshape(n, nb, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    high = (qh.reshape(n, nb, 2, 1, 32) >> shifts) & 0x03  # (N, nb, 2, 4, 32)
    q = (low | (high << 4)).to(torch.int16) - 32
    scale = d.unsqueeze(-1) * sc  # (N, nb, 16): fp16 x int8 is exact in float32
    return q.to(torch.int8).reshape(n, k), scale.reshape(n, -1)


def q4_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q (N, K) uint8 in [0, 15], scale (N, K / 32), offset (N, K / 32)) float32."""
    b, k = _blocks(raw, "Q4_0")
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 2:], 16).reshape(raw.shape[0], k)  # per block: 16 low nibbles, then 16 high
    return q.contiguous(), d, -8.0 * d


def q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q (N, K) uint8 in [0, 15], scale d (N, K / 32), offset m (N, K / 32)) float32."""
    b, k = _blocks(raw, "Q4_1")
    q = _nibbles(b[..., 4:], 16).reshape(raw.shape[0], k)
    return q.contiguous(), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _five_bit(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks (N, nb, bytes) whose qh (a little-endian uint32) starts at byte `at`,
    16 bytes of low nibbles after it -> (N, nb * 32) uint8 codes in [0, 31]: value j takes the
    low nibble of byte j (j < 16) or the high nibble of byte j - 16, and bit j of qh."""
    n = b.shape[0]
    low = _nibbles(b[..., at + 4:at + 20], 16).reshape(n, -1, 32)
    qh = b[..., at:at + 4].to(torch.int64)
    word = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)  # (N, nb)
    high = (word.unsqueeze(-1) >> torch.arange(32)) & 1  # (N, nb, 32)
    return (low | (high.to(torch.uint8) << 4)).reshape(n, -1)


def q5_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q (N, K) int8 in [-16, 15], scale d (N, K / 32) float32)."""
    b, _ = _blocks(raw, "Q5_0")
    return (_five_bit(b, 2).to(torch.int16) - 16).to(torch.int8), _f16(b[..., 0:2])


def q5_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q (N, K) uint8 in [0, 31], scale d (N, K / 32), offset m (N, K / 32)) float32."""
    b, _ = _blocks(raw, "Q5_1")
    return _five_bit(b, 4).contiguous(), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> (sc, m) (..., 8) float32, 6 bits each: sub-blocks 0-3 in the
    low 6 bits of bytes 0-3 (sc) and 4-7 (m); sub-blocks 4-7 from bytes 8-11's nibbles (low:
    sc, high: m) with their top 2 bits in the top 2 bits of bytes 0-3 (sc) and 4-7 (m)."""
    p = packed.to(torch.int32)
    a, m, lo = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([a & 0x3F, (lo & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 0x3F, (lo >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc.float(), mins.float()


def _k_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and offset of each 32-value sub-block of Q4_K / Q5_K blocks (N, nb, bytes)."""
    n = b.shape[0]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (N, nb)
    sc, m = _k_scales(b[..., 4:16])  # (N, nb, 8)
    scale = d.unsqueeze(-1) * sc  # exact: 11 x 6 bits
    offset = -(dmin.unsqueeze(-1) * m)
    return scale.reshape(n, -1), offset.reshape(n, -1)


def q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q (N, K) uint8 in [0, 15], scale (N, K / 32), offset (N, K / 32)) float32."""
    b, k = _blocks(raw, "Q4_K")
    scale, offset = _k_affine(b)
    q = _nibbles(b[..., 16:144], 32)  # (N, nb, 8, 32): sub-block 2i low nibbles of qs[32i:32i+32], 2i+1 high
    return q.reshape(raw.shape[0], k).contiguous(), scale, offset


def q5_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q (N, K) uint8 in [0, 31], scale (N, K / 32), offset (N, K / 32)) float32."""
    b, k = _blocks(raw, "Q5_K")
    n, nb = b.shape[:2]
    scale, offset = _k_affine(b)
    low = _nibbles(b[..., 48:176], 32)  # (N, nb, 8, 32)
    bits = torch.arange(8, dtype=torch.uint8).reshape(8, 1)
    high = (b[..., 16:48].reshape(n, nb, 1, 32) >> bits) & 0x01  # sub-block i's fifth bit: bit i of qh
    return (low | (high << 4)).reshape(n, k).contiguous(), scale, offset


SYMMETRIC = {"Q8_0": q8_0, "Q6_K": q6_k, "Q5_0": q5_0}
AFFINE = {"Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k, "Q5_1": q5_1, "Q5_K": q5_k}


def dequantize(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The (N, K) float32 weight a block tensor stands for (for embeddings, which Stoker holds
    as floats, and for tests): the decoded form expanded, exactly."""
    if kind in SYMMETRIC:
        q, scale = SYMMETRIC[kind](raw)
        return q.float() * scale.repeat_interleave(GROUP_K[kind], dim=1)
    q, scale, offset = AFFINE[kind](raw)
    g = GROUP_K[kind]
    return q.float() * scale.repeat_interleave(g, dim=1) + offset.repeat_interleave(g, dim=1)
