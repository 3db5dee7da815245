"""4-bit weights in torch's tinygemm layout: `torch._weight_int4pack_mm` for decode, and a Triton
kernel that dequantizes the same held bytes for larger batches.

Why: on an H200 (benchmarks/w4a16_gpu.py; docs/benchmarks.md, "4-bit and 8-bit weight-only
GEMMs") tinygemm multiplied one row by Llama-3-8B's projections at 1.8-1.9x bf16 `F.linear`'s
speed and 2-2.3x Stoker's Triton GEMV (qkv 0.0129 ms against 0.0237 bf16 and 0.0298 GEMV), and
stayed the fastest 4-bit path up to M = 8; at M = 64 it took 3-6x dequantize + `F.linear`, and
at 2048 twenty times. So the int4 method (layers/int4_method.py) holds a layer in this layout
only, multiplies M <= TINYGEMM_ROWS rows with tinygemm, and for more rows dequantizes the held
bytes here and calls `F.linear` (cuBLAS), as its other form does. TINYGEMM_ROWS = 32 from an
H100 (docs/benchmarks.md, "GPU: one NVIDIA H100"): at 32 rows tinygemm took 0.26 / 0.14 ms on
gate_up / down, about 0.5 ms a layer, where the engine's dequantize + F.linear path took about
1 ms a layer at batch 64 (a forward of 31.3 ms); tinygemm's time doubles with the rows, so the
two meet near 64.

The layout (torch's CUDA `_convert_weight_to_int4pack(codes, INNER_K_TILES)`): int32 words
(N / 8, K / TILE_K, 32, INNER_K_TILES / 2), eight 4-bit codes each, arranged for the tensor
cores' fragments. Rather than restate the permutation from torch's source (which could change
between releases unnoticed), `nibble_table` asks the op itself: three probe conversions of one
(8, TILE_K) tile whose codes are the 4-bit digits of each element's index give, for every
element (r, c) of a tile, the position j of its code among the 8 * TILE_WORDS codes of the
tile's words (word j // 8, bits 4 (j % 8) to 4 (j % 8) + 3). `check_table` then packs a
multi-tile random matrix both ways and compares every word, so a layout that is not the same
permutation in every tile is refused, not mis-read. The table is (8, TILE_K) int32, asked once
per device.

Values: w = (q - 8) * s + z with q in [0, 15], s and z bfloat16 per output row and group
(scales_and_zeros (K / group, N, 2)), which is the int4 method's w = (q - 8) * s + o' with
z = o'. tinygemm takes bfloat16 activations only, so the method holds this form for bfloat16
models only; s and o' round to bfloat16, a relative step of 2^-9 against the 2^-8 the
activations already carry.

Shapes: N a multiple of 8 (TILE_N), K a multiple of TILE_K (128), group 32, 64, 128 or 256
(`supported`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stoker.kernels._common import check, interpreting
from stoker.kernels.fused_moe import _rounded

INNER_K_TILES = 8  # what gpt-fast and torchao use for K >= 1024; K must be a multiple of 16 * this
TILE_N = 8
TILE_K = 16 * INNER_K_TILES  # 128 columns
TILE_WORDS = TILE_N * TILE_K // 8  # int32 words of one tile
GROUP_SIZES = (32, 64, 128, 256)  # tinygemm's qGroupSize values
TINYGEMM_ROWS = 32  # rows of x up to which tinygemm is taken (the module docstring's measurement)
DEQUANT_BLOCK_N = 32
PROBE_DIGITS = 3  # 4-bit digits of a tile index (TILE_N * TILE_K = 1024 elements: 10 bits)

Convert = Callable[[torch.Tensor, int], torch.Tensor]  # (N, K / 2) uint8, even k high -> int32 words


def supported(n: int, k: int, group_k: int) -> bool:
    return n % TILE_N == 0 and k % TILE_K == 0 and group_k in GROUP_SIZES and k % group_k == 0


def cuda_convert(codes_hi_lo: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack(codes_hi_lo, inner_k_tiles)


def _op_input(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> the op's input: (N, K / 2) uint8, even k in the HIGH nibble."""
    c = codes.to(torch.uint8)
    return ((c[:, 0::2] << 4) | c[:, 1::2]).contiguous()


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words (any shape) -> (numel * 8,) int64 codes, word w's bits 4i..4i+3 at 8w + i."""
    w = words.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int64)
    return ((w[:, None] >> shifts) & 0xF).reshape(-1)


def nibble_table(convert: Convert, device: torch.device) -> torch.Tensor:
    """(TILE_N, TILE_K) int32: the position j, among the 8 * TILE_WORDS codes of a tile's
    words, that `convert` gives element (r, c) of the tile. Raises if the probes do not come
    back as a permutation (the op is not a pure rearrangement of codes)."""
    index = torch.arange(TILE_N * TILE_K, device=device, dtype=torch.int64).reshape(TILE_N, TILE_K)
    source = torch.zeros(TILE_N * TILE_K, dtype=torch.int64, device=device)
    for p in range(PROBE_DIGITS):
        words = convert(_op_input((index >> (4 * p)) & 0xF), INNER_K_TILES)
        check(words.numel() == TILE_WORDS, f"the int4pack op gave {words.numel()} words for one tile, expected {TILE_WORDS}")
        source |= _nibbles(words) << (4 * p)
    check(torch.equal(torch.sort(source).values, torch.arange(source.numel(), device=device)),
          "the int4pack op does not rearrange codes one-to-one; its layout is not held")
    table = torch.empty_like(source)
    table[source] = torch.arange(source.numel(), device=device)
    return table.reshape(TILE_N, TILE_K).to(torch.int32)


def pack_by_table(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(N, K) codes -> the int32 words the table says `convert` makes, (N / 8 * K / TILE_K *
    TILE_WORDS,) (used to check the table, and as the CPU stand-in in tests)."""
    n, k = codes.shape
    tiles = codes.to(torch.int64).reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K).permute(0, 2, 1, 3)
    tiles = tiles.reshape(-1, TILE_N * TILE_K)
    placed = torch.empty_like(tiles)
    placed[:, table.reshape(-1).to(torch.int64)] = tiles
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (placed.reshape(-1, 8) << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def check_table(convert: Convert, table: torch.Tensor, device: torch.device) -> None:
    """Packs a (4 tiles x 3 tiles) random matrix with `convert` and by `table`; raises unless
    every word agrees (the permutation is the same in every tile)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    codes = torch.randint(0, 16, (4 * TILE_N, 3 * TILE_K), generator=gen).to(device)
    by_op = convert(_op_input(codes), INNER_K_TILES).reshape(-1)
    check(torch.equal(by_op, pack_by_table(codes, table)),
          "the int4pack op's layout differs between tiles; its layout is not held")


@functools.cache
def _device_table(device: torch.device) -> torch.Tensor:
    table = nibble_table(cuda_convert, device)
    check_table(cuda_convert, table, device)
    return table


@dataclass
class TinygemmWeight:
    """One layer held in the tinygemm layout."""

    words: torch.Tensor  # int32, the op's (N / 8, K / TILE_K, 32, INNER_K_TILES / 2)
    scales_and_zeros: torch.Tensor  # (K / group, N, 2) bfloat16: s, z
    table: torch.Tensor  # (TILE_N, TILE_K) int32, nibble_table's
    n: int
    k: int
    group_k: int


def hold(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_k: int,
         convert: Convert = cuda_convert, table: torch.Tensor | None = None) -> TinygemmWeight:
    """The int4 method's held form (qweight (N, K / 2) uint8, even k in the low nibble; s (N, G);
    o' (N, G) or None) -> the tinygemm form. `convert` and `table` default to torch's CUDA op
    and the table asked of it on qweight's device."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    check(supported(n, k, group_k), f"tinygemm needs N % {TILE_N} == 0, K % {TILE_K} == 0 and a group in {GROUP_SIZES}; "
                                    f"got N {n}, K {k}, group {group_k}")
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(n, k)
    if table is None:
        table = _device_table(qweight.device)
    words = convert(_op_input(codes), INNER_K_TILES)
    zeros = torch.zeros_like(scale, dtype=torch.float32) if offset is None else offset.float()
    scales_and_zeros = torch.stack([scale.float().t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
    return TinygemmWeight(words, scales_and_zeros, table.contiguous(), n, k, group_k)


def tinygemm_mm(x: torch.Tensor, w: TinygemmWeight) -> torch.Tensor:
    """x (M, K) bfloat16 -> (M, N) bfloat16 through torch's CUDA tinygemm."""
    return torch.ops.aten._weight_int4pack_mm(x, w.words, w.group_k, w.scales_and_zeros)


@triton.jit
def _dequant_tinygemm_kernel(
    words_ptr,  # int32, tiles of TILE_WORDS words, tile (tn, tk) at (tn * num_k_tiles + tk) * TILE_WORDS
    table_ptr,  # (TILE_N, TILE_K) int32
    sz_ptr,  # (K / group, N, 2) bfloat16
    out_ptr,  # (N, K)
    N,
    K,
    group_k,
    num_k_tiles,
    TILES_N: tl.constexpr,  # row tiles a program dequantizes: TILES_N * TILE_N rows, one column tile
    TILE_N_: tl.constexpr,
    TILE_K_: tl.constexpr,
    TILE_WORDS_: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    # (TILES_N, TILE_N, TILE_K): tile t, row r of the tile, column c of the tile. The table is
    # the same for every tile, so it is one contiguous (TILE_N, TILE_K) load broadcast over t;
    # only the words are gathered (each holds 8 of the tile's codes).
    tk = tl.program_id(1)
    t3 = tl.program_id(0) * TILES_N + tl.arange(0, TILES_N)[:, None, None]
    r3 = tl.arange(0, TILE_N_)[None, :, None]
    c3 = tl.arange(0, TILE_K_)[None, None, :]
    n = t3 * TILE_N_ + r3  # (TILES_N, TILE_N, 1)
    k = tk * TILE_K_ + c3  # (1, 1, TILE_K)
    mask = (n < N) & (c3 < TILE_K_)
    pos = tl.load(table_ptr + r3 * TILE_K_ + c3)  # (1, TILE_N, TILE_K)
    word_index = (t3.to(tl.int64) * num_k_tiles + tk) * TILE_WORDS_ + pos // 8
    word = tl.load(words_ptr + word_index, mask=mask, other=0)
    q = ((word >> (4 * (pos % 8))) & 0xF).to(tl.float32)
    g = k // group_k
    sz = sz_ptr + (g.to(tl.int64) * N + n) * 2
    s = tl.load(sz, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(sz + 1, mask=mask, other=0.0).to(tl.float32)
    w = (q - 8.0) * s + z
    tl.store(out_ptr + n.to(tl.int64) * K + k, _rounded(w, out_ptr.dtype.element_ty, RNE_BF16), mask=mask)


def dequant_tinygemm(w: TinygemmWeight, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) `dtype`: (q - 8) * s + z in float32, rounded once (reference.dequant_tinygemm)."""
    check(dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {dtype}")
    out = torch.empty((w.n, w.k), dtype=dtype, device=w.words.device)
    tiles_n = DEQUANT_BLOCK_N // TILE_N
    grid = (triton.cdiv(w.n // TILE_N, tiles_n), w.k // TILE_K)
    _dequant_tinygemm_kernel[grid](
        w.words, w.table, w.scales_and_zeros, out, w.n, w.k, w.group_k, w.k // TILE_K,
        TILES_N=tiles_n, TILE_N_=TILE_N, TILE_K_=TILE_K, TILE_WORDS_=TILE_WORDS,
        RNE_BF16=interpreting() and dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    return out


def reference_dequant(w: TinygemmWeight, dtype: torch.dtype) -> torch.Tensor:
    """Twin of dequant_tinygemm in torch: the codes read back through the table."""
    nib = _nibbles(w.words).reshape(-1, TILE_N * TILE_K)  # (tiles, 1024) in op position order
    tiles = nib[:, w.table.reshape(-1).to(torch.int64)]  # (tiles, 1024) in (r, c) order
    codes = tiles.reshape(w.n // TILE_N, w.k // TILE_K, TILE_N, TILE_K).permute(0, 2, 1, 3).reshape(w.n, w.k)
    s = w.scales_and_zeros[..., 0].float().t().repeat_interleave(w.group_k, dim=1)
    z = w.scales_and_zeros[..., 1].float().t().repeat_interleave(w.group_k, dim=1)
    return ((codes.float() - 8.0) * s + z).to(dtype)
