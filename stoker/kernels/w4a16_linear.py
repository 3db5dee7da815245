"""W4A16 GEMM: y = x @ dequantize(W)^T + bias, W as 4-bit codes in groups along K.

Twin: `reference.w4a16_linear`. The weight is what quantization/int4.py defines,
w = q * s + o per output row and group of `group_k` columns, held in the form the CPU kernel
uses too (kernels/cpu/linear_q4.py): w = (q - 8) * s + o' with o' = o + 8 s, so symmetric
weights (o' = 0: online int4, GGUF Q4_0, symmetric GPTQ / compressed-tensors) hold no offsets
and read none. Decode is memory-bound and reads every weight once per step: half a byte a
weight (plus a 16-bit scale per group) instead of bf16's two is the point.

Each (BLOCK_N, BLOCK_K / 2) tile of packed bytes is loaded once and split into its low
nibbles (the even columns of K) and high nibbles (the odd ones), each dequantized in float32
registers with its group's scale (and offset), cast to x's dtype and fed to tl.dot against
x's even and odd columns: the same products as one dot over the interleaved tile, without
shuffling registers to interleave it. float32 accumulation.

Few rows (decode, M <= DECODE_ROWS): one 16-row tile, narrow N tiles, and K split over
SPLIT_K programs when the N tiles alone would leave SMs idle; each split writes float32
partial sums, which `_split_sum_kernel` adds in split order with the bias, rounding once
(deterministic; at M <= DECODE_ROWS the tiling does not depend on M, so a row's result does
not depend on the batch it is in).

Shapes: x (M, K) float16/bfloat16/float32 (rows contiguous), qweight (N, K / 2) uint8 (even k
in the low nibble: int4.pack), scale (N, G) float16 or float32 with G = K / group_k (or 1 per
channel), offset (N, G) float32 o' or None, bias (N,) or None. BLOCK_K divides group_k (or
group_k >= K), so a K tile sits inside one group: group_k must be a multiple of 32 (the two
half tiles are dots of at least 16 along K) or cover the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import check, check_last_dim_contiguous, check_same_device, dot_args, next_pow2, num_sms
from stoker.kernels.fused_moe import _rounded  # float32 -> bf16 rounded to nearest even under the interpreter too

DECODE_ROWS = 16  # up to this many rows: the decode tiling (one M tile, split K)
MIN_BLOCK_K = 32  # two half tiles of >= 16 columns each for tl.dot
MAX_SPLIT_K = 16


@triton.jit
def _w4a16_linear_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K / 2) uint8
    scale_ptr,  # (N, G) float16 / float32
    offset_ptr,  # (N, G) float32 o' = o + 8 s, or unused
    bias_ptr,  # (N,) or unused
    out_ptr,  # (M, N) x's dtype, or (SPLIT_K, M, N) float32 partial sums
    M,
    N,
    K,
    group_k,
    k_per_split,  # columns of K per split, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,  # between splits' partial sums
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # write float32 partial sums (split K), no bias
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)  # byte j of a tile holds columns 2j (low) and 2j + 1 (high)
    m_mask = m < M
    n_mask = n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        even = k0 + 2 * half  # (BLOCK_K / 2,) even columns; K is even, so even + 1 < K with them
        k_mask = even < k_stop
        packed = tl.load(w_rows + (even // 2)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        g = k0 // group_k
        s = tl.load(scale_ptr + n * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]  # (BLOCK_N, 1)
        w_even = ((packed & 0xF).to(tl.float32) - 8.0) * s  # (BLOCK_N, BLOCK_K / 2)
        w_odd = ((packed >> 4).to(tl.float32) - 8.0) * s
        if HAS_OFFSET:
            o = tl.load(offset_ptr + n * stride_sn + g, mask=n_mask, other=0.0)[:, None]
            w_even += o
            w_odd += o
        xm = m_mask[:, None] & k_mask[None, :]
        x_even = tl.load(x_rows + even[None, :], mask=xm, other=0.0)  # (BLOCK_M, BLOCK_K / 2)
        x_odd = tl.load(x_rows + (even + 1)[None, :], mask=xm, other=0.0)
        if DOT_FP32:  # the interpreter's bfloat16 dot: the same bf16-rounded weights, multiplied in float32
            w_even = _rounded(w_even, x_even.dtype, True).to(tl.float32)
            w_odd = _rounded(w_odd, x_even.dtype, True).to(tl.float32)
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        else:
            w_even = w_even.to(x_even.dtype)
            w_odd = w_odd.to(x_even.dtype)
        acc += tl.dot(x_even, tl.trans(w_even), input_precision=PRECISION)
        acc += tl.dot(x_odd, tl.trans(w_odd), input_precision=PRECISION)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + m[:, None].to(tl.int64) * stride_om + n[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], _rounded(acc, out_ptr.dtype.element_ty, DOT_FP32), mask=out_mask)


@triton.jit
def _split_sum_kernel(
    partial_ptr,  # (SPLIT_K, M * N) float32, contiguous
    bias_ptr,  # (N,) or unused
    out_ptr,  # (M, N) contiguous, x's dtype
    total,  # M * N
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """out = sum of the splits' partial sums in split order, + bias, rounded once: the same
    order for every element whatever M is."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.load(partial_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + s * total + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, _rounded(acc, out_ptr.dtype.element_ty, RNE_BF16), mask=mask)


SPLIT_SUM_BLOCK = 1024


def tile_config(num_rows: int, out_features: int, in_features: int, group_k: int, sms: int) -> dict[str, int]:
    """Tiles by batch rows. Decode (M <= DECODE_ROWS): 16 x 32 tiles, BLOCK_K up to 128 (64
    bytes of a weight row per load), and K split until the programs cover the SMs twice (each
    split keeping at least 4 K tiles): Llama-3-8B's k/v projections (N 1024) give 32 N tiles,
    too few for 132 SMs alone. Larger M: up to 64 x 64 tiles, 8 warps from 32 rows, no split.
    Not yet tuned on a GPU; tests/kernels/aot_sm90.py checks that these configs do not spill."""
    whole_row = group_k >= in_features

    def block_k_from(start: int) -> int:
        block_k = start
        while block_k > MIN_BLOCK_K and not whole_row and group_k % block_k:
            block_k //= 2
        return block_k

    if num_rows <= DECODE_ROWS:
        block_k = block_k_from(128)
        n_tiles = -(-out_features // 32)
        k_tiles = -(-in_features // block_k)
        split = 1
        while split < MAX_SPLIT_K and n_tiles * split < 2 * sms and k_tiles // (2 * split) >= 4:
            split *= 2
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4}
    block_m = min(64, next_pow2(num_rows))
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k_from(64), "SPLIT_K": 1,
            "num_warps": 8 if block_m >= 32 else 4}


def hold_scales(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, G) float32 s and o of w = q * s + o -> what the kernel holds: s in float16 where
    every scale of the layer is exact in it (GPTQ / AWQ / GGUF / online int4 scales are), else
    float32; o' = o + 8 s in float32, or None when all are 0 (symmetric weights)."""
    s32 = scale.float().contiguous()
    s16 = s32.to(torch.float16)
    o8 = (offset.float() + 8.0 * s32).contiguous()
    return (s16 if torch.equal(s16.float(), s32) else s32), (o8 if torch.any(o8) else None)


def w4a16_linear(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (N, K / 2) uint8, even k in the low nibble
    scale: torch.Tensor,  # (N, G) float16 / float32
    offset: torch.Tensor | None,  # (N, G) float32 o' = o + 8 s, or None (symmetric)
    group_k: int,
    bias: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:  # (..., N) in x's dtype
    check(qweight.dim() == 2 and qweight.dtype == torch.uint8, f"qweight must be (N, K / 2) uint8, got {tuple(qweight.shape)} {qweight.dtype}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    check(x.shape[-1] == k, f"x {tuple(x.shape)} does not fit qweight {tuple(qweight.shape)} (two columns of K a byte)")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x dtype {x.dtype}")
    check(group_k > 0 and (group_k >= k or (k % group_k == 0 and group_k % MIN_BLOCK_K == 0)),
          f"group_k {group_k} must divide K = {k} and be a multiple of {MIN_BLOCK_K} (or cover all of K)")
    groups = -(-k // group_k)
    check(scale.shape == (n, groups) and scale.dtype in (torch.float16, torch.float32),
          f"scale must be ({n}, {groups}) float16 or float32, got {tuple(scale.shape)} {scale.dtype}")
    check(offset is None or (offset.shape == (n, groups) and offset.dtype == torch.float32 and offset.stride() == scale.stride()),
          f"offset must be None or ({n}, {groups}) float32 laid out as scale")
    check(bias is None or bias.shape == (n,), f"bias must be ({n},)")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    for name, t in (("qweight", qweight), ("scale", scale)):
        check_last_dim_contiguous(name, t)
    check_same_device(x=rows, qweight=qweight, scale=scale)
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.view(*x.shape[:-1], n)
    tiles = tile_config(num_rows, n, k, group_k, num_sms(x.device.index if x.device.type == "cuda" else None))
    split = tiles.pop("SPLIT_K")
    k_per_split = -(-k // (split * tiles["BLOCK_K"])) * tiles["BLOCK_K"]
    split = -(-k // k_per_split)
    partial = torch.empty((split, num_rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    dot_fp32, precision = dot_args(x.dtype)
    grid = (triton.cdiv(num_rows, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]), split)
    _w4a16_linear_kernel[grid](
        rows, qweight, scale, offset if offset is not None else scale, bias if bias is not None else scale, partial,
        num_rows, n, k, group_k if group_k < k else k + tiles["BLOCK_K"], k_per_split,
        rows.stride(0), qweight.stride(0), scale.stride(0), partial.stride(-2), partial.stride(0) if split > 1 else 0,
        HAS_OFFSET=offset is not None, HAS_BIAS=bias is not None, PARTIAL=split > 1,
        DOT_FP32=dot_fp32, PRECISION=precision, **tiles,
    )  # fmt: skip
    if split > 1:
        split_sum(partial, bias, out, rne_bf16=dot_fp32)
    return out.view(*x.shape[:-1], n)


def split_sum(partial: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, rne_bf16: bool) -> None:
    """out (M, N) = the sum of partial (SPLIT_K, M, N) float32 in split order, + bias (N,),
    rounded once (`_split_sum_kernel`); shared by the split-K launchers."""
    split, num_rows, n = partial.shape
    total = num_rows * n
    _split_sum_kernel[(triton.cdiv(total, SPLIT_SUM_BLOCK),)](
        partial, bias if bias is not None else partial, out, total, n,
        SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=SPLIT_SUM_BLOCK, RNE_BF16=rne_bf16,
    )  # fmt: skip
