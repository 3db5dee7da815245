"""Fused Mixture-of-Experts for CUDA: every expert's two GEMMs in two launches, no host sync.

Twin: `reference.fused_moe_grouped`. Shapes (FusedMoE's layout, layers/moe.py):

    x             (T, H)       float16 / bfloat16 / float32, rows contiguous
    w13           (E, 2I, H)   each expert's [gate; up] rows: the model dtype, or int8 / float8_e4m3fn
    w2            (E, H, I)    each expert's down projection
    w13_scale     (E, 2I, G13) float32, 8-bit weights only: one scale per row and group of
                               group_k13 columns (layers/moe_quant.py; per channel G = 1,
                               128 x 128 blocks brought to rows by formats.scale_rows, G = ceil(H/128))
    w2_scale      (E, H, G2)   float32
    topk_weights  (T, k)       float32 routing weights
    topk_ids      (T, k)       int64 expert of each choice

Steps, all on the device with shapes fixed by (T, k, E, BLOCK_M), so a CUDA graph holds them:

1. Alignment (`moe_align_block_size`): the P = T * k (token, slot) pairs, counted per expert
   and sorted by expert (stable: token order within an expert), each expert's run padded to a
   multiple of BLOCK_M with the sentinel P. The padded length is at most
   P + E * (BLOCK_M - 1) whatever the routing, so the buffers and grids are sized by that and
   the kernels skip the blocks past the actual length, which they read on the device.
   Every block of BLOCK_M sorted slots then belongs to one expert (`block_expert_ids`).
2. Gate/up GEMM (`_moe_gate_up_kernel`), grid (blocks, I / BLOCK_N): the block's rows of x
   (gathered by token = pair // k) times the expert's gate rows and up rows, two float32
   accumulators, the gated activation in float32 in the epilogue, stored once in x's dtype as
   `act` (P, I) at each pair's row.
3. Down GEMM (`_moe_down_kernel`), grid (blocks, H / BLOCK_N): `act` rows times the expert's
   w2, float32 accumulation, times the pair's routing weight, stored in x's dtype as
   `per_choice` (P, H).
4. Top-k sum (`_moe_sum_kernel`): each token's k rows added in float32 in ascending expert
   order (the choices are put in that order before step 1, as layers/moe.expert_by_expert
   sums them), rounded once.

One token (T <= SMALL_BATCH_TOKENS, batch-1 decode; chosen from the shapes, `small_batch` forces
either way): steps 1-4 above pad each touched expert's one or two pairs to a BLOCK_M >= 16 tl.dot
tile and leave the down GEMM to P x H / 64 programs walking all of I, far from memory speed
(measured on an H200 at batch 1: 14% of its bandwidth). The small-batch path instead: the pairs
sorted by expert on the device, then GEMV-style kernels (`_moe_small_gate_up_kernel`,
`_moe_small_down_kernel`, section below) with one program per (pair, BLOCK_N rows, K split),
float32 partials of the down GEMM, and `_moe_small_sum_kernel` adding splits, routing weights
and choices in the twin's order and roundings. Measured on the H200 (benchmarks/moe_gpu.py,
Mixtral-8x7B-shaped layer, docs/benchmarks.md "GPU: one NVIDIA H200"): at 1 token the small
path took 0.395 ms (bf16) / 0.516 (fp8) against the tiled path's 0.596 / 1.153; at 8 tokens
(16 pairs, ~2 per touched expert, each re-read per pair) the tiled path won, 0.736 / 0.707
against 0.985 / 1.216. Hence one token, where every pair has an expert of its own.

8-bit weights are dequantized in the tile as kernels/w8_linear.py does (q * scale in float32,
then the operand dtype), so the GEMMs see the weight the twin dequantizes; BLOCK_K divides the
scale group so one K tile reads one scale per row. Activations stay in the model dtype
(weight-only, as the other quantized expert backends).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import (FLOAT_DTYPES, check, check_last_dim_contiguous, check_same_device, dot_args, interpreting,
                                    num_sms)

# The gated activations FusedMoE knows (layers/activation.py), by the constexpr the kernel takes.
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


@triton.jit
def _gate(g, ACT: tl.constexpr):
    """The gate's activation, float32 in and out (ACTIVATIONS)."""
    if ACT == 0:  # silu
        return g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # gelu, exact (erf)
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation; tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * u)))
    else:  # relu
        return tl.maximum(g, 0.0)


@triton.jit
def _rounded(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 -> dtype. RNE_BF16 (interpreter, bfloat16 only): the interpreter (triton 3.9)
    truncates float32 -> bfloat16 where the GPU rounds to nearest even, so the rounding is done
    on the bits first and the cast is then exact; on a GPU the flag is off and this is a cast."""
    if RNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _as_operand(w, dtype: tl.constexpr, BITS_BF16: tl.constexpr, RNE_BF16: tl.constexpr):
    """A dequantized float32 weight rounded to the operand dtype and back to float32 (the twin's
    weight). BITS_BF16: to bfloat16 by round-to-nearest-even on the bits (integer ops, already
    float32: no conversion instructions, which run at a quarter of the FMA rate, in the small-batch
    kernels' inner loop); otherwise through the dtype."""
    if BITS_BF16:
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return _rounded(w, dtype, RNE_BF16).to(tl.float32)


@triton.jit
def _weight_f32(w):
    """Loaded weights as float32; int8 by the 1.5 * 2^23 trick (integer add, float subtract),
    not the int-to-float conversion instruction, a quarter of the FMA rate on the GPU."""
    if w.dtype == tl.int8:
        return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return w.to(tl.float32)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,  # (T, H)
    w_ptr,  # (E, 2I, H)
    scale_ptr,  # (E, 2I, G) float32, or unused
    sorted_ids_ptr,  # (L,) int32 pair index, P = padding
    block_expert_ptr,  # (L / BLOCK_M,) int32
    num_padded_ptr,  # (1,) int32 the padded length actually used
    act_ptr,  # (P, I)
    num_pairs,
    H,
    I,
    group_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_am,
    TOP_K: tl.constexpr,
    QUANT: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the padded length this routing needs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    m_mask = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < I
    kk = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    up_rows = gate_rows + I * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        k_mask = k < H
        a = tl.load(x_ptr + token[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        wg = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)  # (BLOCK_N, BLOCK_K)
        wu = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        if QUANT:
            s_rows = scale_ptr + expert * stride_se + n * stride_sn + k0 // group_k  # (BLOCK_N,)
            wg = wg.to(tl.float32) * tl.load(s_rows, mask=n_mask, other=0.0)[:, None]
            wu = wu.to(tl.float32) * tl.load(s_rows + I * stride_sn, mask=n_mask, other=0.0)[:, None]
            wg = _rounded(wg, a.dtype, RNE_BF16)  # the dequantized weight in the operand dtype, as the twin
            wu = _rounded(wu, a.dtype, RNE_BF16)
        if DOT_FP32:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_gate += tl.dot(a, tl.trans(wg), input_precision=PRECISION)
        acc_up += tl.dot(a, tl.trans(wu), input_precision=PRECISION)
    out = _gate(acc_gate, ACT) * acc_up  # (BLOCK_M, BLOCK_N) float32
    dst = act_ptr + pair[:, None].to(tl.int64) * stride_am + n[None, :]
    tl.store(dst, _rounded(out, act_ptr.dtype.element_ty, RNE_BF16), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr,  # (P, I)
    w_ptr,  # (E, H, I)
    scale_ptr,  # (E, H, G) float32, or unused
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    pair_weight_ptr,  # (P,) float32 routing weight of each pair
    out_ptr,  # (P, H)
    num_pairs,
    H,
    I,
    group_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pair < num_pairs
    rows = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < H
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        k_mask = k < I
        a = tl.load(act_ptr + rows[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if QUANT:
            s = tl.load(scale_ptr + expert * stride_se + n * stride_sn + k0 // group_k, mask=n_mask, other=0.0)
            w = _rounded(w.to(tl.float32) * s[:, None], a.dtype, RNE_BF16)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    acc *= tl.load(pair_weight_ptr + pair, mask=m_mask, other=0.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_om + n[None, :]
    tl.store(dst, _rounded(acc, out_ptr.dtype.element_ty, RNE_BF16), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_sum_kernel(
    per_choice_ptr,  # (T * k, H), a token's k rows adjacent, in ascending expert order
    out_ptr,  # (T, H)
    H,
    stride_pm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(per_choice_ptr + (token * TOP_K + j) * stride_pm + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, _rounded(acc, out_ptr.dtype.element_ty, RNE_BF16), mask=mask)


# ---- small batch: few (token, slot) pairs, GEMV-style (no tl.dot) at memory speed ---------------------
#
# At decode a pair is one token and one expert: a tl.dot tile of BLOCK_M >= 16 rows holds one real
# row, and the alignment's grid is sized for the worst routing, so most programs exit at once; the
# down GEMM's few live programs (P x H / 64) each walked all of I alone. Here instead each program
# owns BLOCK_N rows of one pair's expert weight and a K chunk: the rows are read contiguous along
# K (16-byte vectors per thread, a warp per row), multiplied by the pair's x (or act) row in
# float32 and each K tile reduced with tl.sum (within a warp) into BLOCK_N float32 sums, which
# keeps registers low (32-96 at the sm_90 configs) and so many programs resident; the grid covers
# the SMs several times (BLOCK_N small for the gate/up GEMM; K split for the down GEMM, whose
# float32 partials the top-k sum pass adds in a fixed order: deterministic). Pairs are taken in
# expert order, so two pairs of one expert are adjacent programs and the second reads the weight
# tile from L2. 8-bit weights are dequantized as the tiled kernels do (q * scale in float32,
# rounded to x's dtype: the twin's weight; BLOCK_K divides the scale group) but without
# conversion instructions for int8 and the bfloat16 rounding (`_weight_f32`, `_as_operand`).
# Applying the scale after the sum instead would save ~3 more operations per weight but moves
# bf16 outputs ~4.5e-3 (relative norm) off the twin, a full rounding: not done while unmeasured.


@triton.jit
def _moe_small_gate_up_kernel(
    x_ptr,  # (T, H)
    w_ptr,  # (E, 2I, H)
    scale_ptr,  # (E, 2I, G) float32, or unused
    order_ptr,  # (P,) int32 the pairs sorted by expert
    ids_ptr,  # (P,) int64 the expert of each pair
    act_ptr,  # (P, I)
    H,
    I,
    group_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_am,
    TOP_K: tl.constexpr,
    QUANT: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITS_BF16: tl.constexpr,  # x is bfloat16: round dequantized weights on the bits
    RNE_BF16: tl.constexpr,
):
    pair = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)  # int64 offsets: E x 2I x H passes 2^31 (DeepSeek-V3)
    x_row = x_ptr + (pair // TOP_K) * stride_xm
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < I
    kk = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    up_rows = gate_rows + I * stride_wn
    s_rows = scale_ptr + expert * stride_se + n.to(tl.int64) * stride_sn  # (BLOCK_N,)
    zero_rows = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        k_mask = k < H
        w_mask = n_mask[:, None] & k_mask[None, :]
        # x's row for each weight row (L1 hits): loaded in the weight tile's layout, so no
        # conversion through shared memory (and its barrier) per K tile
        a = tl.load(x_row + (k[None, :] + zero_rows), mask=w_mask, other=0.0).to(tl.float32)
        wg = _weight_f32(tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0))
        wu = _weight_f32(tl.load(up_rows + k[None, :], mask=w_mask, other=0.0))
        if QUANT:  # BLOCK_K divides the group: one scale per row in this tile; rounded as the twin
            sg = tl.load(s_rows + k0 // group_k, mask=n_mask, other=0.0)[:, None]
            su = tl.load(s_rows + I * stride_sn + k0 // group_k, mask=n_mask, other=0.0)[:, None]
            wg = _as_operand(wg * sg, x_ptr.dtype.element_ty, BITS_BF16, RNE_BF16)
            wu = _as_operand(wu * su, x_ptr.dtype.element_ty, BITS_BF16, RNE_BF16)
        acc_gate += tl.sum(wg * a, axis=1)
        acc_up += tl.sum(wu * a, axis=1)
    out = _gate(acc_gate, ACT) * acc_up  # (BLOCK_N,)
    tl.store(act_ptr + pair * stride_am + n, _rounded(out, act_ptr.dtype.element_ty, RNE_BF16), mask=n_mask)


@triton.jit
def _moe_small_down_kernel(
    act_ptr,  # (P, I)
    w_ptr,  # (E, H, I)
    scale_ptr,  # (E, H, G) float32, or unused
    order_ptr,  # (P,) int32
    ids_ptr,  # (P,) int64
    partial_ptr,  # (P, SPLIT_K, H) float32: each K chunk's sums, unweighted
    H,
    I,
    group_k,
    k_chunk,  # columns per split, a multiple of BLOCK_K
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_pm,
    stride_ps,
    QUANT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITS_BF16: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    pair = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    split = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)  # int64 offsets: E x 2I x H passes 2^31 (DeepSeek-V3)
    a_row = act_ptr + pair * stride_am
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < H
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
    s_rows = scale_ptr + expert * stride_se + n.to(tl.int64) * stride_sn
    zero_rows = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_start = split * k_chunk
    k_stop = tl.minimum(k_start + k_chunk, I)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + kk
        k_mask = k < k_stop
        w_mask = n_mask[:, None] & k_mask[None, :]
        a = tl.load(a_row + (k[None, :] + zero_rows), mask=w_mask, other=0.0).to(tl.float32)  # as in gate/up
        w = _weight_f32(tl.load(w_rows + k[None, :], mask=w_mask, other=0.0))
        if QUANT:
            s = tl.load(s_rows + k0 // group_k, mask=n_mask, other=0.0)[:, None]
            w = _as_operand(w * s, act_ptr.dtype.element_ty, BITS_BF16, RNE_BF16)
        acc += tl.sum(w * a, axis=1)
    tl.store(partial_ptr + pair * stride_pm + split * stride_ps + n, acc, mask=n_mask)  # every split writes, empty ones 0


@triton.jit
def _moe_small_sum_kernel(
    partial_ptr,  # (T * k, SPLIT_K, H) float32, a token's k pairs adjacent, in ascending expert order
    pair_weight_ptr,  # (T * k,) float32
    out_ptr,  # (T, H)
    H,
    stride_pm,
    stride_ps,
    stride_om,
    TOP_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Per choice: its K chunks summed in split order, times the routing weight, rounded to the
    output dtype (the twin's per-choice rounding); the token's choices summed in float32, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        h = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            h += tl.load(partial_ptr + pair * stride_pm + s * stride_ps + cols, mask=mask, other=0.0)
        choice = _rounded(h * tl.load(pair_weight_ptr + pair), out_ptr.dtype.element_ty, RNE_BF16)
        acc += choice.to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, _rounded(acc, out_ptr.dtype.element_ty, RNE_BF16), mask=mask)


def moe_align_block_size(
    topk_ids: torch.Tensor,  # (T, k) int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert, each expert's run padded to a multiple of
    block_m, in torch ops on the device (no host read, so a CUDA graph can hold them).

    Returns sorted_ids (L,) int32: flat pair index t * k + j, P = T * k marks padding;
    block_expert_ids (L / block_m,) int32: the expert of each block, num_experts past the end;
    num_padded (1,) int32: the padded length in use. L = cdiv(P + E (block_m - 1), block_m) * block_m,
    the worst case over every routing, so every shape depends on (T, k, E, block_m) alone.
    """
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    # counts per expert: index_add_ of ones, as layers/moe_load.py (bincount on CUDA reads the max back)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # (E,)
    first = counts.cumsum(0) - counts  # where each expert's run starts, unpadded
    order = torch.argsort(flat, stable=True)  # (P,) pairs by expert, token order within one
    expert_of = flat.index_select(0, order)
    rank = torch.arange(num_pairs, device=device) - first.index_select(0, expert_of)
    dest = (padded_end - padded).index_select(0, expert_of) + rank
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=device) * block_m
    # the expert whose padded run holds each block's first slot (empty experts' ends repeat and are skipped)
    block_expert_ids = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_ids, block_expert_ids, padded_end[-1:].to(torch.int32)


def tile_config(num_pairs: int, num_experts: int, group_k13: int, group_k2: int, hidden: int,
                inter: int) -> dict[str, int]:
    """BLOCK_M by the average pairs per expert (decode: few, so a narrow M tile wastes little on
    padding); BLOCK_K halved until it divides the 8-bit scale groups. 8 warps: with 4, ptxas
    spilled the gate/up kernel's two weight tiles at BLOCK_M 16 (tests/kernels/aot_sm90.py
    checks these configs compile for sm_90 without spills). Not yet tuned on a GPU."""
    block_m = 16 if num_pairs <= 4 * num_experts else 64
    block_k = 64
    while block_k > 16 and ((group_k13 < hidden and group_k13 % block_k) or (group_k2 < inter and group_k2 % block_k)):
        block_k //= 2
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 8}


# the small-batch path up to this many tokens (batch-1 decode; measured, see the module docstring)
SMALL_BATCH_TOKENS = 1


def small_tile_config(num_pairs: int, weight_bytes: int, group_k13: int, group_k2: int, hidden: int, inter: int,
                      sms: int = 132) -> dict[str, int]:
    """Tiles of the small-batch kernels, from shapes only. BLOCK_K: one 16-byte vector per lane
    of a warp along a weight row (256 bf16, 128 float32, 512 8-bit columns), halved until it
    divides the 8-bit scale groups; BLOCK_N: 32 weight elements per thread and tile at 4 warps,
    halved (gate/up) until P x I / BLOCK_N programs cover the SMs 8 times; the down GEMM's K is
    split (a power of 2, at least 4 K tiles per split) until P x H / BLOCK_N x SPLIT_K does."""

    def k_tile(group_k: int, k: int) -> int:
        block_k = 32 * 16 // weight_bytes
        while block_k > 16 and group_k < k and group_k % block_k:
            block_k //= 2
        return min(block_k, max(16, 1 << (k - 1).bit_length()))

    def n_tile(block_k: int, n: int) -> int:
        return min(4096 // block_k, 64, max(1, 1 << (n - 1).bit_length()))

    target = 8 * sms
    bk13, bk2 = k_tile(group_k13, hidden), k_tile(group_k2, inter)
    bn13, bn2 = n_tile(bk13, inter), n_tile(bk2, hidden)
    while bn13 > 4 and num_pairs * triton.cdiv(inter, bn13) < target:
        bn13 //= 2
    split = 1
    while split < 16 and num_pairs * triton.cdiv(hidden, bn2) * split < target and inter >= 8 * split * bk2:
        split *= 2
    return {"BLOCK_N13": bn13, "BLOCK_K13": bk13, "BLOCK_N2": bn2, "BLOCK_K2": bk2, "SPLIT_K": split, "num_warps": 4}


def _fused_moe_small(x, w13, w2, pair_weights, ids, activation, s13, s2, gk13, gk2, out) -> torch.Tensor:
    """The small-batch path (the GEMV-style kernels above): ids (T, k) each token's experts in
    ascending order, pair_weights (T * k,) their routing weights."""
    num_tokens, top_k = ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    quant = w13.dtype in QUANT_DTYPES
    grouped13, grouped2 = quant and gk13 < hidden, quant and gk2 < inter
    t = small_tile_config(num_pairs, w13.element_size(), gk13, gk2, hidden, inter, num_sms(x.device.index))
    check(not grouped13 or gk13 % t["BLOCK_K13"] == 0, f"group_k13 {gk13} must be a multiple of 16")
    check(not grouped2 or gk2 % t["BLOCK_K2"] == 0, f"group_k2 {gk2} must be a multiple of 16")
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True).to(torch.int32)  # pairs by expert: one expert's programs adjacent
    rne_bf16 = interpreting() and x.dtype == torch.bfloat16
    bits_bf16 = x.dtype == torch.bfloat16
    s13 = s13 if quant else pair_weights  # any tensor for the unused pointer
    s2 = s2 if quant else pair_weights
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _moe_small_gate_up_kernel[(num_pairs, triton.cdiv(inter, t["BLOCK_N13"]))](
        x, w13, s13, order, flat, act, hidden, inter, gk13,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0) if quant else 0, s13.stride(1) if quant else 0,
        act.stride(0),
        TOP_K=top_k, QUANT=quant, ACT=ACTIVATIONS[activation], BLOCK_N=t["BLOCK_N13"],
        BLOCK_K=t["BLOCK_K13"], BITS_BF16=bits_bf16, RNE_BF16=rne_bf16, num_warps=t["num_warps"],
    )  # fmt: skip
    split = t["SPLIT_K"]
    k_chunk = triton.cdiv(triton.cdiv(inter, split), t["BLOCK_K2"]) * t["BLOCK_K2"]
    partial = torch.empty((num_pairs, split, hidden), dtype=torch.float32, device=x.device)
    _moe_small_down_kernel[(num_pairs, triton.cdiv(hidden, t["BLOCK_N2"]), split)](
        act, w2, s2, order, flat, partial, hidden, inter, gk2, k_chunk,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0) if quant else 0, s2.stride(1) if quant else 0,
        partial.stride(0), partial.stride(1),
        QUANT=quant, BLOCK_N=t["BLOCK_N2"], BLOCK_K=t["BLOCK_K2"], BITS_BF16=bits_bf16, RNE_BF16=rne_bf16,
        num_warps=t["num_warps"],
    )  # fmt: skip
    block = 1024
    _moe_small_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        partial, pair_weights, out, hidden, partial.stride(0), partial.stride(1), out.stride(0),
        TOP_K=top_k, SPLIT_K=split, BLOCK=block, RNE_BF16=rne_bf16,
    )  # fmt: skip
    return out


def _check_weight(name: str, w: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor, scale: torch.Tensor | None,
                  group_k: int | None) -> int:
    """Checks one expert weight (and its scales); returns the group_k the kernel is given."""
    check(tuple(w.shape) == shape, f"{name} must be {shape}, got {tuple(w.shape)}")
    check_last_dim_contiguous(name, w)
    k = shape[2]
    if w.dtype in QUANT_DTYPES:
        check(scale is not None and group_k is not None, f"{name} is {w.dtype}: its scales and group_k are needed")
        assert scale is not None and group_k is not None
        groups = -(-k // group_k)
        check(tuple(scale.shape) == (*shape[:2], groups) and scale.dtype == torch.float32,
              f"{name}_scale must be {(*shape[:2], groups)} float32, got {tuple(scale.shape)} {scale.dtype}")
        check(scale.stride(2) == 1, f"{name}_scale: last dim must be contiguous")
        return group_k if group_k < k else k + 64  # one group: k0 // group_k is 0 for every tile
    check(w.dtype == x.dtype, f"{name} is {w.dtype}, x is {x.dtype}: float experts run in the model dtype")
    check(scale is None, f"{name} is {w.dtype}: float experts take no scales")
    return k + 64


def fused_moe(
    x: torch.Tensor,  # (T, H)
    w13: torch.Tensor,  # (E, 2I, H)
    w2: torch.Tensor,  # (E, H, I)
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k) int64
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,  # (E, 2I, G13) float32, 8-bit w13 only
    w2_scale: torch.Tensor | None = None,  # (E, H, G2) float32
    group_k13: int | None = None,
    group_k2: int | None = None,
    small_batch: bool | None = None,  # the GEMV-style path; None: when T <= SMALL_BATCH_TOKENS
) -> torch.Tensor:  # (T, H) in x's dtype
    check(x.dim() == 2 and x.dtype in FLOAT_DTYPES, f"x must be (T, H) float16/bfloat16/float32, got {tuple(x.shape)} {x.dtype}")
    check(w13.dim() == 3 and w2.dim() == 3, f"w13 must be (E, 2I, H) and w2 (E, H, I), got {tuple(w13.shape)}, {tuple(w2.shape)}")
    check(activation in ACTIVATIONS, f"activation {activation!r}: the kernel has {list(ACTIVATIONS)}")
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    check(two_i % 2 == 0 and x.shape[1] == hidden, f"x {tuple(x.shape)} does not fit w13 {tuple(w13.shape)}")
    gk13 = _check_weight("w13", w13, (num_experts, 2 * inter, hidden), x, w13_scale, group_k13)
    gk2 = _check_weight("w2", w2, (num_experts, hidden, inter), x, w2_scale, group_k2)
    check((w13.dtype in QUANT_DTYPES) == (w2.dtype in QUANT_DTYPES), "w13 and w2 must be both 8-bit or both float")
    num_tokens, top_k = topk_ids.shape
    check(topk_weights.shape == (num_tokens, top_k) and topk_weights.dtype == torch.float32 and num_tokens == x.shape[0],
          f"topk_weights must be ({x.shape[0]}, k) float32 like topk_ids {tuple(topk_ids.shape)}, "
          f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    check(not topk_ids.dtype.is_floating_point, f"topk_ids must be integer, got {topk_ids.dtype}")
    check_last_dim_contiguous("x", x)
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    quant = w13.dtype in QUANT_DTYPES
    # each token's choices in ascending expert order (the order they are summed in), weights with them
    ids, perm = topk_ids.sort(dim=1)
    pair_weights = topk_weights.gather(1, perm).reshape(-1)  # (P,)
    if small_batch if small_batch is not None else num_tokens <= SMALL_BATCH_TOKENS:
        return _fused_moe_small(x, w13, w2, pair_weights, ids, activation, w13_scale, w2_scale, gk13, gk2, out)
    tiles = tile_config(num_tokens * top_k, num_experts, gk13, gk2, hidden, inter)
    warps = tiles.pop("num_warps")
    block_m = tiles["BLOCK_M"]
    check(gk13 >= hidden or gk13 % tiles["BLOCK_K"] == 0, f"group_k13 {group_k13} must be a multiple of 16")
    check(gk2 >= inter or gk2 % tiles["BLOCK_K"] == 0, f"group_k2 {group_k2} must be a multiple of 16")

    sorted_ids, block_expert_ids, num_padded = moe_align_block_size(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    # an expert's blocks hold at least one pair each, so at most P blocks are in use: no programs
    # for the rest of the worst-case length (they would only read num_padded and exit)
    num_blocks = min(block_expert_ids.numel(), num_pairs)
    dot_fp32, precision = dot_args(x.dtype)
    rne_bf16 = interpreting() and x.dtype == torch.bfloat16
    s13 = w13_scale if quant else pair_weights  # any tensor for the unused pointer
    s2 = w2_scale if quant else pair_weights
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, w13, s13, sorted_ids, block_expert_ids, num_padded, act,
        num_pairs, hidden, inter, gk13,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0) if quant else 0, s13.stride(1) if quant else 0,
        act.stride(0),
        TOP_K=top_k, QUANT=quant, ACT=ACTIVATIONS[activation], DOT_FP32=dot_fp32, PRECISION=precision,
        RNE_BF16=rne_bf16, num_warps=warps, **tiles,
    )  # fmt: skip
    per_choice = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, tiles["BLOCK_N"]))](
        act, w2, s2, sorted_ids, block_expert_ids, num_padded, pair_weights, per_choice,
        num_pairs, hidden, inter, gk2,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0) if quant else 0, s2.stride(1) if quant else 0,
        per_choice.stride(0),
        QUANT=quant, DOT_FP32=dot_fp32, PRECISION=precision, RNE_BF16=rne_bf16, num_warps=warps, **tiles,
    )  # fmt: skip
    block = 1024
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        per_choice, out, hidden, per_choice.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block, RNE_BF16=rne_bf16,
    )
    return out
