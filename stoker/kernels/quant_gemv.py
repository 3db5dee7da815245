"""Decode GEMV for quantized weights: y = x @ dequantize(W)^T + bias for a few rows of x.

Twins: `reference.gemv_w4` and `reference.gemv_w8` (the same products and group sums in
float32; within float32-accumulation tolerance of `reference.w4a16_linear` / `w8_linear` for
float32 x, see below for 16-bit x).

Why a GEMV: at decode (M = 1..8 rows) the quantized GEMMs (w4a16_linear.py, w8_linear.py) pad
M to a 16-row tl.dot tile and read narrow weight tiles; on the H200 (benchmarks/w4a16_gpu.py)
the W4A16 tile kernel took 0.0856 ms on Llama-3-8B's qkv at M = 1 where bf16 F.linear took
0.0225, and the int8 tile kernel 0.0377, though they read a quarter and a half of bf16's
bytes. Here nothing is a dot. A program owns BLOCK_N output rows and a chunk of K; all its
THREADS_K = 128 threads (four warps) lie along K, each owning VEC contiguous bytes of every one
of the BLOCK_N rows per step (VEC = 4 for 4-bit: the thread's 8 columns of a 16-bit x row are
then one 16-byte load, laid out as its weight bytes, so the compiler needs no shuffle through
shared memory; a warp reads 128 contiguous bytes of a row per step; 8-bit takes 16 bytes of
one row, W8_VEC, which measured faster, its x columns loaded 8 at a time). Each
row of x (up to 8) is loaded once per step and broadcast over the BLOCK_N weight rows; each
has its own (BLOCK_N, THREADS_K) float32 accumulator: a thread's 8 products are summed as one
multiply and seven FMAs (`_dot8`; tl.sum multiplied all and added in a tree), multiplied by
the group's scale once per thread and step, and one cross-thread tl.sum per row finishes at
the end. ptxas (tests/kernels/aot_sm90.py) compiles every launch config without spills or
shared-memory shuffles in the loop; in PTX a 4-bit weight costs ~5 instructions at M = 1
(byte extract, nibble mask / shift, OR of the exponent, FADD, FMA), so the 4-bit GEMV may be
bound by issue near the copy rate rather than by bytes: the H200 run will say.

4-bit: the int4 method's held form (w4a16_linear.py): w = (q - 8) * s + o' with packed
(N, K / 2) uint8 codes (even k in the low nibble), s float16 / float32 per row and group of
group_k columns, o' float32 or None (symmetric). A nibble becomes q - 8 exactly without an
int->float conversion (a conversion instruction issues at a fraction of the FMA rate): (q | 0x4B000000) read as a
float is 2^23 + q, minus (2^23 + 8). Per group and row the kernel sums (q - 8) * x over the
thread's columns, then multiplies by s once and adds o' * sum(x) once: w itself is never
formed, so it is never rounded to x's dtype. That differs from `reference.w4a16_linear`,
which rounds w to x's dtype before the product (as the tl.dot tile kernel must): for float32
x both agree to float32 accumulation; for bfloat16 x the GEMV is the more exact of the two
(its error against the float32 product of the unrounded weight is float32 rounding only), and
differs from the old twin by the twin's bf16 weight rounding (~1e-3 relative). Its own twin
`reference.gemv_w4` reproduces it to float32 accumulation order.

8-bit weight-only: int8 or float8_e4m3fn (N, K) with float32 scales (N, G) per row and group
of group_k columns (per channel: G = 1), as w8_linear.py. Same structure: sum q * x over the
thread's VEC columns in float32, times s once. int8 codes become floats by the same trick
((q + 128) | 0x4B000000, minus 2^23 + 128); fp8 through the hardware's e4m3 conversion.

Few rows only (M <= GEMV_ROWS = 8): every 4-bit weight costs ~3 ALU ops to decode plus one
FMA per row, so the arithmetic grows with M while the bytes do not. Measured on an H200
(benchmarks/w4a16_gpu.py; docs/benchmarks.md, "GPU: one NVIDIA H200"), the GEMVs stream 0.4-1.6
TB/s at M = 1 (the copy rate is 4.3) and at M = 8 lose to dequantize + F.linear (4-bit) and to
the tile kernel (int8): the methods that call them take them for M <= 4 (int4_method) and M = 1
(triton_w8), and FP8 `scaled_mm` for M <= 8. BLOCK_N narrows as BLOCK_M = next_pow2(M) grows so
that the accumulators fit in registers (tile_config); a row's sums do not depend on BLOCK_N and
the split of K does not depend on M, so for 1..8 rows a row's result does not depend on the
batch it is in (a batch of 9+ rows takes another kernel, with other sums).

Launch configs: tile_config's rule, or the launchers' keywords vec (4 / 8 / 16 bytes of a row
a thread and step for 4-bit, 8 / 16 for 8-bit: the wider ones sum a thread's 16 or 32 columns as
`_dot8`s of 8 contiguous ones, each with its own 16-byte load of x: no shuffle through shared memory), block_n, num_warps (THREADS_K = 32 * num_warps) and split_k, which
benchmarks/w4a16_gpu.py --sweep times (SWEEP_TILES) to pick the rule from.

Split K: when the N blocks alone would not give every SM two programs (a K/V projection of
N = 1024, tensor-parallel shards), K is split into SPLIT_K chunks whose float32 partial sums
`w4a16_linear._split_sum_kernel` adds in split order with the bias, rounding once
(deterministic). Otherwise one pass writes the result with its bias.

Shapes: x (M, K) float16 / bfloat16 / float32, rows contiguous; K a multiple of 32 (the
launchers refuse other K, which the tile kernels serve); out (M, N) in x's dtype, optionally
given (`out=`), every element written. No host syncs and only torch.empty allocations, so the
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import check, check_last_dim_contiguous, check_same_device, interpreting, next_pow2, num_sms
from stoker.kernels.fused_moe import _rounded
from stoker.kernels.w4a16_linear import split_sum

GEMV_ROWS = 8  # at most this many rows of x (see the module docstring)
NUM_WARPS = 4
THREADS_K = 32 * NUM_WARPS  # every thread of a program along K (see tile_config)
MAX_SPLIT_K = 16


@triton.jit
def _halves(t):
    """(A, B, 2C) -> two (A, B, C): the even and the odd entries of the last dim (in-thread)."""
    return tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2] // 2, 2)))


@triton.jit
def _dot8(w, x):
    """(A, B) sums over the last dim (8, held by one thread) of w * x as one multiply and seven
    FMAs (tl.sum would multiply all eight and add them in a tree)."""
    w0, w1 = _halves(w)
    x0, x1 = _halves(x)
    w00, w01 = _halves(w0)
    w10, w11 = _halves(w1)
    x00, x01 = _halves(x0)
    x10, x11 = _halves(x1)
    wa, wb = _halves(w00)
    xa, xb = _halves(x00)
    acc = wa * xa
    acc = tl.fma(wb, xb, acc)
    wa, wb = _halves(w01)
    xa, xb = _halves(x01)
    acc = tl.fma(wa, xa, acc)
    acc = tl.fma(wb, xb, acc)
    wa, wb = _halves(w10)
    xa, xb = _halves(x10)
    acc = tl.fma(wa, xa, acc)
    acc = tl.fma(wb, xb, acc)
    wa, wb = _halves(w11)
    xa, xb = _halves(x11)
    acc = tl.fma(wa, xa, acc)
    acc = tl.fma(wb, xb, acc)
    return tl.reshape(acc, (acc.shape[0], acc.shape[1]))


@triton.jit
def _front_back(t):
    """(A, B, 2C) -> the first and the last C entries of the last dim (held by one thread)."""
    return tl.split(tl.permute(tl.reshape(t, (t.shape[0], t.shape[1], 2, t.shape[2] // 2)), (0, 1, 3, 2)))


@triton.jit
def _x8(x_ptr, row, M, stride_xm, col0, mask):
    """(1, T, 8) float32: x[row]'s 8 columns from col0 (1, T, 1) on, one 16-byte load of 16-bit x."""
    ok = mask & (tl.full([1, 1, 1], row, tl.int32) < M)
    return tl.load(x_ptr + row * stride_xm + col0 + tl.arange(0, 8)[None, None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _dot_row(w, x_ptr, row, M, stride_xm, col0, mask):
    """(BN, T) sums of w (BN, T, C) times x[row]'s C = 8 / 16 / 32 columns from col0 (1, T, 1) on,
    and (1, T) the sums of those columns of x. Each 8 columns of x are one load and one `_dot8`
    (a load of 16 or 32 columns would be split over 2 / 4 threads by the coalescing pass and
    shuffled through shared memory into w's layout)."""
    if w.shape[2] == 8:
        x0 = _x8(x_ptr, row, M, stride_xm, col0, mask)
        acc = _dot8(w, tl.broadcast_to(x0, w.shape))
        x_sum = tl.sum(x0, axis=2)
    elif w.shape[2] == 16:
        w0, w1 = _front_back(w)
        x0 = _x8(x_ptr, row, M, stride_xm, col0, mask)
        x1 = _x8(x_ptr, row, M, stride_xm, col0 + 8, mask)
        acc = _dot8(w0, tl.broadcast_to(x0, w0.shape)) + _dot8(w1, tl.broadcast_to(x1, w1.shape))
        x_sum = tl.sum(x0, axis=2) + tl.sum(x1, axis=2)
    else:
        wa, wb = _front_back(w)
        w0, w1 = _front_back(wa)
        w2, w3 = _front_back(wb)
        x0 = _x8(x_ptr, row, M, stride_xm, col0, mask)
        x1 = _x8(x_ptr, row, M, stride_xm, col0 + 8, mask)
        x2 = _x8(x_ptr, row, M, stride_xm, col0 + 16, mask)
        x3 = _x8(x_ptr, row, M, stride_xm, col0 + 24, mask)
        acc = ((_dot8(w0, tl.broadcast_to(x0, w0.shape)) + _dot8(w1, tl.broadcast_to(x1, w1.shape)))
               + (_dot8(w2, tl.broadcast_to(x2, w2.shape)) + _dot8(w3, tl.broadcast_to(x3, w3.shape))))
        x_sum = (tl.sum(x0, axis=2) + tl.sum(x1, axis=2)) + (tl.sum(x2, axis=2) + tl.sum(x3, axis=2))
    return acc, x_sum


@triton.jit
def _w4_row(acc, x_ptr, row, M, stride_xm, col0, c_mask, w, s, o, HAS_OFFSET: tl.constexpr):
    """acc (BN, T) += s * sum over the thread's columns of (q - 8) * x[row] (+ o' * sum x[row])."""
    dot, x_sum = _dot_row(w, x_ptr, row, M, stride_xm, col0, c_mask)
    acc += dot * s
    if HAS_OFFSET:
        acc += x_sum * o
    return acc


@triton.jit
def _store_row(out_ptr, acc, row, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL: tl.constexpr, RNE_BF16: tl.constexpr):
    res = tl.sum(acc, axis=1)  # (BN,)
    mask = n_mask & (tl.full([1], row, tl.int32) < M)
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + row * stride_om + n, res, mask=mask)
    else:
        tl.store(out_ptr + row * stride_om + n, _rounded(res + bias, out_ptr.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit
def _gemv_w4_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K / 2) uint8, even k in the low nibble
    scale_ptr,  # (N, G) float16 / float32
    offset_ptr,  # (N, G) float32 o', or unused
    bias_ptr,  # (N,) or unused
    out_ptr,  # (M, N) x's dtype, or (SPLIT_K, M, N) float32 partial sums
    M,
    N,
    half_k,  # K / 2: bytes of a weight row
    bytes_per_split,  # a multiple of THREADS_K * VEC
    group_k,  # columns of a scale group (> K: one per row)
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x, up to 8, each with its own accumulator
    BLOCK_N: tl.constexpr,
    THREADS_K: tl.constexpr,
    VEC: tl.constexpr,  # bytes of a row per thread and step, 4 / 8 / 16 (2 * VEC columns of x: one 16-byte load at VEC 4)
    RNE_BF16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Every index is built in 3-D (BN, T, V) from the start, so the weight tile, the x rows
    # broadcast over it and the scales share one layout (no shuffles through shared memory).
    n3 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    t3 = tl.arange(0, THREADS_K)[None, :, None]
    v3 = tl.arange(0, VEC)[None, None, :]
    n_mask3 = n3 < N
    w_rows = w_ptr + n3.to(tl.int64) * stride_wn
    s_rows = n3.to(tl.int64) * stride_sn
    b_start = pid_k * bytes_per_split
    b_stop = tl.minimum(half_k, b_start + bytes_per_split)
    acc0 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    for b0 in range(b_start, b_stop, THREADS_K * VEC):
        first = b0 + t3 * VEC  # (1, T, 1) the first byte of each thread's VEC
        t_mask = first < b_stop  # a thread's VEC bytes lie wholly inside or outside (K % 32 == 0)
        packed = tl.load(w_rows + (first + v3), mask=n_mask3 & t_mask, other=0).to(tl.int32)  # (BN, T, V)
        # q - 8 for the low (even k) and high (odd k) nibbles, exact, without an int -> float convert
        lo = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        # interleaved back to column order in registers: (BN, T, 2V), laid out as the x rows' 16-byte loads
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, THREADS_K, 2 * VEC))
        g = (2 * first) // group_k  # a thread's 2 * VEC (<= 32) columns lie in one group (group_k % 32 == 0)
        st_mask = n_mask3 & t_mask
        s = tl.sum(tl.load(scale_ptr + s_rows + g, mask=st_mask, other=0.0).to(tl.float32), axis=2)  # (BN, T)
        if HAS_OFFSET:
            o = tl.sum(tl.load(offset_ptr + s_rows + g, mask=st_mask, other=0.0), axis=2)
        else:
            o = s
        col0 = 2 * first  # (1, T, 1) the thread's first column of x
        acc0 = _w4_row(acc0, x_ptr, 0, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
        if BLOCK_M > 1:
            acc1 = _w4_row(acc1, x_ptr, 1, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
        if BLOCK_M > 2:
            acc2 = _w4_row(acc2, x_ptr, 2, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
            acc3 = _w4_row(acc3, x_ptr, 3, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
        if BLOCK_M > 4:
            acc4 = _w4_row(acc4, x_ptr, 4, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
            acc5 = _w4_row(acc5, x_ptr, 5, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
            acc6 = _w4_row(acc6, x_ptr, 6, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
            acc7 = _w4_row(acc7, x_ptr, 7, M, stride_xm, col0, t_mask, w, s, o, HAS_OFFSET)
    _finish(out_ptr, bias_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M, N, pid_n, pid_k, stride_om, stride_os,
            HAS_BIAS, PARTIAL, BLOCK_M, BLOCK_N, RNE_BF16)


@triton.jit
def _finish(out_ptr, bias_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M, N, pid_n, pid_k, stride_om, stride_os,
            HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RNE_BF16: tl.constexpr):
    """One cross-thread sum per row, then the row's results (+ bias) or its split's partial sums."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS and not PARTIAL:
        bias = tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    _store_row(out_ptr, acc0, 0, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)
    if BLOCK_M > 1:
        _store_row(out_ptr, acc1, 1, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)
    if BLOCK_M > 2:
        _store_row(out_ptr, acc2, 2, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)
        _store_row(out_ptr, acc3, 3, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)
    if BLOCK_M > 4:
        _store_row(out_ptr, acc4, 4, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)
        _store_row(out_ptr, acc5, 5, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)
        _store_row(out_ptr, acc6, 6, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)
        _store_row(out_ptr, acc7, 7, M, n, n_mask, stride_om, stride_os, pid_k, bias, PARTIAL, RNE_BF16)


@triton.jit
def _w8_row(acc, x_ptr, row, M, stride_xm, first, k_mask, q, s):
    """acc (BN, T) += s * sum over the thread's columns (from first (1, T, 1) on) of q * x[row]."""
    dot, x_sum = _dot_row(q, x_ptr, row, M, stride_xm, first, k_mask)
    return acc + dot * s


@triton.jit
def _gemv_w8_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K) int8 / float8_e4m3fn
    scale_ptr,  # (N, G) float32
    bias_ptr,  # (N,) or unused
    out_ptr,  # (M, N) x's dtype, or (SPLIT_K, M, N) float32 partial sums
    M,
    N,
    K,
    k_per_split,  # a multiple of THREADS_K * VEC
    group_k,  # columns of a scale group (> K: one per row)
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    INT8: tl.constexpr,  # int8 weights (else float8_e4m3fn)
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    THREADS_K: tl.constexpr,
    VEC: tl.constexpr,  # columns (bytes) of a row per thread and step, 8 / 16 (8: 8 bytes of w, 16 of bf16 x)
    RNE_BF16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n3 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    t3 = tl.arange(0, THREADS_K)[None, :, None]
    v3 = tl.arange(0, VEC)[None, None, :]
    n_mask3 = n3 < N
    w_rows = w_ptr + n3.to(tl.int64) * stride_wn
    s_rows = n3.to(tl.int64) * stride_sn
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    acc0 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N, THREADS_K], dtype=tl.float32)
    for k0 in range(k_start, k_stop, THREADS_K * VEC):
        first = k0 + t3 * VEC  # (1, T, 1)
        t_mask = first < k_stop  # whole VECs (K % 32 == 0)
        k = first + v3  # (1, T, V)
        raw = tl.load(w_rows + k, mask=n_mask3 & t_mask, other=0.0)  # (BN, T, V)
        if INT8:  # q + 128 in [0, 255] as the low bits of 2^23: exact, without an int -> float convert
            q = (((raw.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.int32)) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        else:
            q = raw.to(tl.float32)
        g = first // group_k  # a thread's VEC (<= 16) columns lie in one group (group_k % 16 == 0)
        s = tl.sum(tl.load(scale_ptr + s_rows + g, mask=n_mask3 & t_mask, other=0.0), axis=2)  # (BN, T)
        acc0 = _w8_row(acc0, x_ptr, 0, M, stride_xm, first, t_mask, q, s)
        if BLOCK_M > 1:
            acc1 = _w8_row(acc1, x_ptr, 1, M, stride_xm, first, t_mask, q, s)
        if BLOCK_M > 2:
            acc2 = _w8_row(acc2, x_ptr, 2, M, stride_xm, first, t_mask, q, s)
            acc3 = _w8_row(acc3, x_ptr, 3, M, stride_xm, first, t_mask, q, s)
        if BLOCK_M > 4:
            acc4 = _w8_row(acc4, x_ptr, 4, M, stride_xm, first, t_mask, q, s)
            acc5 = _w8_row(acc5, x_ptr, 5, M, stride_xm, first, t_mask, q, s)
            acc6 = _w8_row(acc6, x_ptr, 6, M, stride_xm, first, t_mask, q, s)
            acc7 = _w8_row(acc7, x_ptr, 7, M, stride_xm, first, t_mask, q, s)
    _finish(out_ptr, bias_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M, N, pid_n, pid_k, stride_om, stride_os,
            HAS_BIAS, PARTIAL, BLOCK_M, BLOCK_N, RNE_BF16)


VECS = {4: (4, 8, 16), 8: (8, 16)}  # a thread's bytes of a row per step that the kernels take, by weight bits
# 8-bit: one 16-byte weight load of one row a thread per step (BLOCK_N 1). On an H100
# (benchmarks/w4a16_gpu.py --sweep, int8 per channel, Llama-3-8B's qkv / gate_up / down;
# docs/benchmarks.md, "GPU: one NVIDIA H100") it took 0.0181 / 0.0636 / 0.0344 ms at M = 1
# against 0.0263 / 0.0818 / 0.0450 for the earlier 8 bytes over 4 rows, 1.1-1.5x faster at
# M = 2 and 4 but for gate_up at 4 (3% slower). fp8 runs the same loads (not swept).
W8_VEC = 16
WARPS = (1, 2, 4, 8, 16)


def tile_config(num_rows: int, out_features: int, row_bytes: int, bits: int, sms: int, *, vec: int | None = None,
                block_n: int | None = None, num_warps: int | None = None, split_k: int | None = None) -> dict[str, int]:
    """The launch config for `num_rows` (<= GEMV_ROWS) rows, N = out_features and `row_bytes`
    bytes of a weight row. Four warps, all THREADS_K = 128 threads along K. VEC, a thread's
    bytes of a row per step, makes the thread's columns of a 16-bit x row one 16-byte load
    laid out as its weight bytes: 4 bytes (8 columns) for 4-bit weights (8-bit: W8_VEC, 16
    bytes of one row, BLOCK_N 1, measured); a 4-bit program then reads 512 contiguous bytes of
    each of its rows per step. BLOCK_N (the rows each thread reads, 4-bit): 32 bytes of weights
    a thread per step (8 rows) while BLOCK_N * BLOCK_M <= 16, fewer beyond, since each row of x keeps its own
    accumulator of BLOCK_N values a thread and more spilled. SPLIT_K: doubled while the N
    blocks alone give fewer than two programs per SM and each split keeps >= 2 steps (Llama-3-
    8B's qkv at M = 1: 768 programs, one pass). tests/kernels/aot_sm90.py checks that these
    configs compile for sm_90 without spills.

    The keywords override one choice each (None: the rule above, which they then feed): `vec`
    (VECS[bits]: 16 bytes is one 16-byte weight load a thread, 2 * 16 columns of x for 4-bit),
    `block_n` (a power of two), `num_warps` (THREADS_K = 32 * num_warps, all along K) and
    `split_k` (the splits of K, M's for every M). A row's sums depend on VEC, THREADS_K and the
    split, not on BLOCK_N or M: a choice of those three kept for every M keeps a row's result
    independent of its batch (benchmarks/w4a16_gpu.py --sweep times the choices)."""
    check(vec is None or vec in VECS[bits], f"vec {vec}: the {bits}-bit GEMV takes {VECS[bits]}")
    check(block_n is None or (block_n > 0 and block_n & (block_n - 1) == 0), f"block_n {block_n} must be a power of two")
    check(num_warps is None or num_warps in WARPS, f"num_warps {num_warps} must be one of {WARPS}")
    check(split_k is None or split_k >= 1, f"split_k {split_k} must be >= 1")
    block_m = next_pow2(num_rows)
    vec = vec or (4 if bits == 4 else W8_VEC)
    warps = num_warps or NUM_WARPS
    threads_k = 32 * warps
    if block_n is None:
        block_n = max(1, min(32 // vec, 16 // block_m))
        if bits == 8:
            block_n = 1  # 16 bytes of one row a thread per step (W8_VEC); fp8 at 2 rows spilled at M = 8
    if split_k is None:
        # the split counts blocks of the widest BLOCK_N whatever M is: the same split, so the same
        # order of every row's sums, for 1..8 rows (a row's result does not depend on its batch)
        n_blocks = -(-out_features // max(1, 32 // vec))
        steps = -(-row_bytes // (threads_k * vec))
        split_k = 1
        while split_k < MAX_SPLIT_K and n_blocks * split_k < 2 * sms and steps // (2 * split_k) >= 2:
            split_k *= 2
    step = threads_k * vec
    split_k = -(-row_bytes // (-(-row_bytes // (split_k * step)) * step))  # the splits of whole steps a launch makes
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "THREADS_K": threads_k, "VEC": vec, "SPLIT_K": split_k, "num_warps": warps}


def _tiles(vec: int, block_n: int, num_warps: int, split_k: int | None = None) -> dict[str, int | None]:
    return {"vec": vec, "block_n": block_n, "num_warps": num_warps, "split_k": split_k}


# Launch configs that benchmarks/w4a16_gpu.py --sweep times, by weight bits: tile_config's keywords,
# {} = its rule. block_n is the N block at one row; sweep_tiles narrows it as M grows. Around
# the rule: wider VECs (16-byte weight loads) at the same weight bytes a thread per step (32 or
# 16), 2 / 4 / 8 warps, and a forced split of K. tests/kernels/aot_sm90.py compiles each for
# sm_90 at M = 1 and 4 and fails on a spill.
SWEEP_TILES: dict[int, list[dict[str, int | None]]] = {
    4: [{}, _tiles(4, 4, 4), _tiles(4, 8, 8), _tiles(4, 8, 2), _tiles(8, 4, 4), _tiles(8, 2, 4), _tiles(8, 4, 8),
        _tiles(16, 2, 4), _tiles(16, 1, 4), _tiles(16, 2, 8), _tiles(16, 2, 2), _tiles(4, 8, 4, 2), _tiles(16, 2, 4, 2)],
    8: [{}, _tiles(8, 2, 4), _tiles(8, 4, 8), _tiles(8, 4, 2), _tiles(16, 4, 4), _tiles(16, 2, 4), _tiles(16, 1, 4),
        _tiles(16, 2, 8), _tiles(16, 2, 2), _tiles(8, 4, 4, 2), _tiles(16, 2, 4, 2)],
}


def sweep_tiles(bits: int, num_rows: int) -> list[dict[str, int | None]]:
    """SWEEP_TILES[bits] at `num_rows` rows, block_n narrowed so that a thread's decoded weights
    (BLOCK_N x its 2 * VEC (4-bit) / VEC (8-bit) columns, float32) stay <= 128 / BLOCK_M, since
    each row of x adds its own columns and BLOCK_N accumulators (4-bit VEC 16 with 2 rows of N
    at M = 4 spilled ~100 bytes); duplicates dropped."""
    block_m = next_pow2(num_rows)
    seen, tiles = set(), []
    for t in SWEEP_TILES[bits]:
        if t:
            columns = 2 * t["vec"] if bits == 4 else t["vec"]
            t = dict(t, block_n=min(t["block_n"], max(1, 128 // block_m // columns)))
        key = tuple(sorted(t.items()))
        if key not in seen:
            seen.add(key)
            tiles.append(t)
    return tiles


def supports(num_rows: int, in_features: int, group_k: int, bits: int) -> bool:
    """Whether the GEMV serves this call: few rows, K a multiple of 32 (whole VECs), and scale
    groups holding a thread's columns whole (multiples of 32 for 4-bit, 16 for 8-bit, or one
    group a row)."""
    unit = 32 if bits == 4 else 16
    return 0 < num_rows <= GEMV_ROWS and in_features % 32 == 0 and (group_k >= in_features or group_k % unit == 0)


def _prepare(x: torch.Tensor, k: int, n: int, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    check(x.shape[-1] == k, f"x {tuple(x.shape)} does not fit a weight of {k} input columns")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x dtype {x.dtype}")
    check(k % 32 == 0, f"the GEMV needs K a multiple of 32, got {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    check(rows.shape[0] <= GEMV_ROWS, f"the GEMV serves at most {GEMV_ROWS} rows, got {rows.shape[0]}")
    if out is None:
        out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    else:
        check(out.shape == (rows.shape[0], n) and out.dtype == x.dtype and out.is_contiguous(),
              f"out must be ({rows.shape[0]}, {n}) {x.dtype} contiguous, got {tuple(out.shape)} {out.dtype}")
    return rows, out


def _launch(kernel, rows: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, n: int, row_bytes: int, bits: int,
            args_before_split: tuple, args_after_split: tuple, constexprs: dict, overrides: dict) -> None:
    num_rows = rows.shape[0]
    tiles = tile_config(num_rows, n, row_bytes, bits, num_sms(rows.device.index if rows.device.type == "cuda" else None), **overrides)
    split = tiles.pop("SPLIT_K")
    step = tiles["THREADS_K"] * tiles["VEC"]
    per_split = -(-row_bytes // (split * step)) * step  # bytes of a row per split
    split = -(-row_bytes // per_split)
    partial = torch.empty((split, num_rows, n), dtype=torch.float32, device=rows.device) if split > 1 else out
    rne = interpreting() and rows.dtype == torch.bfloat16
    kernel[(triton.cdiv(n, tiles["BLOCK_N"]), split)](
        *args_before_split, partial, num_rows, n, row_bytes, per_split,  # bytes; for 8-bit weights also columns
        *args_after_split, partial.stride(-2), partial.stride(0) if split > 1 else 0,
        PARTIAL=split > 1, RNE_BF16=rne, **constexprs, **tiles,
    )  # fmt: skip
    if split > 1:
        split_sum(partial, bias, out, rne_bf16=rne)


def gemv_w4(
    x: torch.Tensor,  # (..., K), at most GEMV_ROWS rows
    qweight: torch.Tensor,  # (N, K / 2) uint8, even k in the low nibble
    scale: torch.Tensor,  # (N, G) float16 / float32
    offset: torch.Tensor | None,  # (N, G) float32 o' = o + 8 s, or None (symmetric)
    group_k: int,
    bias: torch.Tensor | None = None,  # (N,)
    out: torch.Tensor | None = None,  # (M, N) x's dtype, contiguous
    *,
    vec: int | None = None,  # launch config overrides (tile_config; None: its rule)
    block_n: int | None = None,
    num_warps: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:  # (..., N) in x's dtype
    check(qweight.dim() == 2 and qweight.dtype == torch.uint8, f"qweight must be (N, K / 2) uint8, got {tuple(qweight.shape)} {qweight.dtype}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    check(group_k > 0 and (group_k >= k or (k % group_k == 0 and group_k % 32 == 0)),
          f"group_k {group_k} must divide K = {k} and be a multiple of 32 (or cover all of K)")
    groups = -(-k // group_k)
    check(scale.shape == (n, groups) and scale.dtype in (torch.float16, torch.float32),
          f"scale must be ({n}, {groups}) float16 or float32, got {tuple(scale.shape)} {scale.dtype}")
    check(offset is None or (offset.shape == (n, groups) and offset.dtype == torch.float32 and offset.stride() == scale.stride()),
          f"offset must be None or ({n}, {groups}) float32 laid out as scale")
    check(bias is None or bias.shape == (n,), f"bias must be ({n},)")
    rows, out = _prepare(x, k, n, out)
    for name, t in (("qweight", qweight), ("scale", scale)):
        check_last_dim_contiguous(name, t)
    check_same_device(x=rows, qweight=qweight, scale=scale, out=out)
    if rows.shape[0]:
        _launch(_gemv_w4_kernel, rows, out, bias, n, k // 2, 4,
                (rows, qweight, scale, offset if offset is not None else scale, bias if bias is not None else scale),
                (group_k if group_k < k else k + 64, rows.stride(0), qweight.stride(0), scale.stride(0)),
                dict(HAS_OFFSET=offset is not None, HAS_BIAS=bias is not None),
                dict(vec=vec, block_n=block_n, num_warps=num_warps, split_k=split_k))
    return out.view(*x.shape[:-1], n)


def gemv_w8(
    x: torch.Tensor,  # (..., K), at most GEMV_ROWS rows
    qweight: torch.Tensor,  # (N, K) int8 / float8_e4m3fn
    scale: torch.Tensor,  # (N, G) float32 (a (N, 1) view of per-channel scales will do)
    group_k: int,
    bias: torch.Tensor | None = None,  # (N,)
    out: torch.Tensor | None = None,  # (M, N) x's dtype, contiguous
    *,
    vec: int | None = None,  # launch config overrides (tile_config; None: its rule)
    block_n: int | None = None,
    num_warps: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:  # (..., N) in x's dtype
    check(qweight.dim() == 2 and qweight.dtype in (torch.int8, torch.float8_e4m3fn),
          f"qweight must be (N, K) int8 or float8_e4m3fn, got {tuple(qweight.shape)} {qweight.dtype}")
    n, k = qweight.shape
    check(group_k > 0 and (group_k >= k or group_k % 16 == 0), f"group_k {group_k} must be a multiple of 16 (or cover all of K)")
    groups = -(-k // group_k)
    check(scale.shape == (n, groups) and scale.dtype == torch.float32, f"scale must be ({n}, {groups}) float32, got {tuple(scale.shape)} {scale.dtype}")
    check(bias is None or bias.shape == (n,), f"bias must be ({n},)")
    rows, out = _prepare(x, k, n, out)
    check_last_dim_contiguous("qweight", qweight)
    check(groups == 1 or scale.stride(-1) == 1, "scale: groups must be contiguous")
    check_same_device(x=rows, qweight=qweight, scale=scale, out=out)
    if rows.shape[0]:
        _launch(_gemv_w8_kernel, rows, out, bias, n, k, 8,
                (rows, qweight, scale, bias if bias is not None else scale),
                (group_k if group_k < k else k + 64, rows.stride(0), qweight.stride(0), scale.stride(0)),
                dict(INT8=qweight.dtype == torch.int8, HAS_BIAS=bias is not None),
                dict(vec=vec, block_n=block_n, num_warps=num_warps, split_k=split_k))
    return out.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------------------------------
# Many rows (prefill) of 4-bit weights: dequantize the layer to x's dtype once, then cuBLAS.


@triton.jit
def _dequant_w4_kernel(
    w_ptr,  # (N, K / 2) uint8
    scale_ptr,  # (N, G) float16 / float32
    offset_ptr,  # (N, G) float32 o', or unused
    out_ptr,  # (N, K) x's dtype, contiguous
    N,
    half_k,
    group_k,
    stride_wn,
    stride_sn,
    HAS_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,  # bytes of a row per program
    RNE_BF16: tl.constexpr,
):
    """w = (q - 8) * s (+ o') in float32, rounded to out's dtype: the weight reference.w4a16_linear
    builds. Each program: BLOCK_N rows x BLOCK_B bytes (2 * BLOCK_B columns, inside one group)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    n_mask = n < N
    mask = n_mask[:, None] & (b < half_k)[None, :]
    packed = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + b[None, :], mask=mask, other=0).to(tl.int32)
    g = (2 * tl.program_id(1) * BLOCK_B) // group_k
    s = tl.load(scale_ptr + n.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    lo = ((packed & 0xF).to(tl.float32) - 8.0) * s
    hi = ((packed >> 4).to(tl.float32) - 8.0) * s
    if HAS_OFFSET:
        o = tl.load(offset_ptr + n.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0)[:, None]
        lo += o
        hi += o
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * BLOCK_B))  # columns 2b (low nibble), 2b + 1 (high)
    c = 2 * tl.program_id(1) * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * (2 * half_k) + c[None, :], _rounded(w, out_ptr.dtype.element_ty, RNE_BF16),
             mask=n_mask[:, None] & (c < 2 * half_k)[None, :])


DEQUANT_BLOCK_N = 16
DEQUANT_BLOCK_B = 64  # 128 columns: inside one group for group sizes that are multiples of 128 ...


def dequant_w4(
    qweight: torch.Tensor,  # (N, K / 2) uint8
    scale: torch.Tensor,  # (N, G) float16 / float32
    offset: torch.Tensor | None,  # (N, G) float32 o', or None
    group_k: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # (N, K) dtype
    """The layer's weight in `dtype`, as reference.dequant_w4 (and reference.w4a16_linear) builds it."""
    check(qweight.dim() == 2 and qweight.dtype == torch.uint8, f"qweight must be (N, K / 2) uint8, got {qweight.dtype}")
    check(dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {dtype}")
    n, half_k = qweight.shape
    k = 2 * half_k
    check(group_k >= k or (k % group_k == 0 and group_k % 32 == 0), f"group_k {group_k} must divide K = {k} and be a multiple of 32")
    check_last_dim_contiguous("qweight", qweight)
    check_last_dim_contiguous("scale", scale)
    block_b = DEQUANT_BLOCK_B
    while group_k < k and group_k % (2 * block_b):  # ... and narrower for groups of 32 or 64
        block_b //= 2
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(half_k, block_b))
    _dequant_w4_kernel[grid](
        qweight, scale, offset if offset is not None else scale, out, n, half_k, group_k if group_k < k else k + 64,
        qweight.stride(0), scale.stride(0), HAS_OFFSET=offset is not None, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_B=block_b,
        RNE_BF16=interpreting() and dtype == torch.bfloat16, num_warps=4,
    )  # fmt: skip
    return out
