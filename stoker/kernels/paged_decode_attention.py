"""Paged decode attention, flash-decoding style: one query token per sequence.

Twin: `reference.paged_decode_attention`.

Decode reads the whole KV cache to produce one token per sequence, so the kernel must stream
K/V at memory speed. Two choices do that:
  * GQA-aware: one program owns one KV head and all GROUP = H / Hkv query heads that share it,
    as the rows of a (GROUP, D) x (D, BLOCK_N) tile product, so each K/V element is read once
    per sequence, not once per query head.
  * Split along the context (flash-decoding, Dao et al. 2023): at small batch, B * Hkv programs
    cannot fill the GPU, so each sequence's context is cut into NUM_SPLITS equal partitions
    processed in parallel; each writes a normalised partial output and its log-sum-exp, and a
    second kernel combines them. The partition size is derived in-kernel from each sequence's
    own context length, so the launch depends on shapes only: no host sync, graph-capturable.
FP8 caches (float8_e4m3fn): each K/V tile is widened to the query's dtype as it is loaded
(exact: every E4M3 value is a bf16/fp16/fp32 value); the layer's k scale joins the softmax
scale and its v scale multiplies the output, so the loop is the float one.
Logit soft-capping (Gemma 2, USE_SOFT_CAP): each score s becomes cap x tanh(s / cap) before the
mask, in the log2 units the loop works in (cap x log2(e)); tanh from exp2 (`soft_cap`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    check,
    check_last_dim_contiguous,
    check_same_device,
    dot_args,
    next_pow2,
    num_sms,
)

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


@triton.jit
def soft_cap(s, cap):
    """cap x tanh(s / cap), elementwise; tanh(x) = sign(x) (1 - e) / (1 + e), e = 2^(-2|x| log2(e)),
    which stays finite for any |x| (e -> 0, tanh -> +-1)."""
    x = s / cap
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, H, D)
    k_cache_ptr,  # (num_blocks, block_size, Hkv, D)
    v_cache_ptr,
    block_tables_ptr,  # (B, max_blocks) int32
    context_lens_ptr,  # (B,)
    out_ptr,  # (B, H, D): written directly when NUM_SPLITS == 1
    part_out_ptr,  # (B, H, NUM_SPLITS, D) float32: each split's normalised output
    part_lse_ptr,  # (B, H, NUM_SPLITS) float32: each split's log2-sum-exp2 of scores
    scale_log2,  # softmax scale * k_scale * log2(e): the kernel works with exp2
    v_scale,  # FP8 caches: multiplies the output (1.0 otherwise)
    window,  # sliding window in tokens (used when USE_WINDOW)
    cap_log2,  # logit soft cap x log2(e) (used when USE_SOFT_CAP)
    block_size,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # Equal partitions of this sequence's context, rounded to whole BLOCK_N steps.
    part = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * part
    if NUM_SPLITS > 1:
        if start >= ctx_len:  # this split has no tokens; the reduce never reads it
            return
    end = tl.minimum(start + part, ctx_len)
    lo = start
    if USE_WINDOW:  # the query at position ctx_len - 1 sees positions >= ctx_len - window
        lo = tl.maximum(lo, ctx_len - window)
    lo_step = (lo // BLOCK_N) * BLOCK_N  # step starts aligned to BLOCK_N: coalesced page reads

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g  # query heads sharing this KV head: (BLOCK_G,)
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Online softmax state (Milakov & Gimelshein 2018). m starts finite so that a step whose
    # scores are all masked gives exp2(-inf - m) = 0 rather than NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    kv_base = kv_head * stride_ch + d[None, :]
    for step in range(lo_step, end, BLOCK_N):
        pos = step + n  # (BLOCK_N,) context positions
        valid = (pos >= lo) & (pos < end)
        page = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
        offs = page.to(tl.int64)[:, None] * stride_cb + (pos % block_size)[:, None] * stride_cs + kv_base
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N)
        if USE_SOFT_CAP:
            s = soft_cap(s, cap_log2)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # l_i == 0 only when the window leaves this split empty; such a split reports lse = -inf.
    has_any = l_i > 0
    out = acc * v_scale / tl.where(has_any, l_i, 1.0)[:, None]  # (BLOCK_G, BLOCK_D)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        row = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # (BLOCK_G,)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + row, tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf")), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    context_lens_ptr,  # (B,)
    part_out_ptr,  # (B, H, NUM_SPLITS, D) float32
    part_lse_ptr,  # (B, H, NUM_SPLITS) float32
    out_ptr,  # (B, H, D)
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # One program per (sequence, query head): out = sum_s w_s * o_s / sum_s w_s, w_s = 2^lse_s.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    part = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_used = tl.cdiv(ctx_len, tl.maximum(part, 1))  # splits the first kernel wrote
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_used
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + s  # (NUM_SPLITS,)
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_mask, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)  # context_len 0 -> zeros
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Split buffers; fully rewritten where read (tests swap in a NaN-filled one to check)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def tile_config(head_dim: int, group: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and warps of the split kernel, chosen so that ptxas reports no register
    spills for sm_90 (checked without a GPU by tests/kernels/test_kernel_compile_sm90.py):
    the per-element K/V gather pointers cost registers, so a K/V step holds at most 8K
    16-bit (4K float32) elements, over 8 warps. Not yet tuned on a GPU."""
    block_d = next_pow2(head_dim)
    budget = 4096 if dtype == torch.float32 else 8192
    return {
        "BLOCK_G": max(16, next_pow2(group)),  # tl.dot needs >= 16 rows
        "BLOCK_D": block_d,
        "BLOCK_N": max(16, min(64, budget // block_d)),
        "num_warps": 8,
    }


def _pick_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Enough splits that B * Hkv * splits programs give every SM about two, from shapes only.

    max_context is an upper bound (block_tables width * block_size): it caps the count at one
    BLOCK_N step per split. A split's K/V steps run one after another, each waiting on its
    block-table load, so at small batch the kernel is latency-bound: on an H200, Llama-3-8B at
    B = 1, context 1024, 8 splits of 2 steps took 11.8 us per layer for 4 MB of KV
    (docs/benchmarks.md, "GPU figures"). Splits beyond the context return at once.
    Rounded down to a power of two so at most log2(_MAX_SPLITS) + 1 kernel variants get compiled.
    """
    want = triton.cdiv(2 * num_sms(device.index if device.type == "cuda" else None), num_seqs * num_kv_heads)
    splits = max(1, min(want, triton.cdiv(max_context, block_n), _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D): one query token per sequence, at position context_len - 1
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32/int64, each >= 1 (0 yields zeros)
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,  # (B, H, D) in query's dtype; allocated if None
    num_splits: int | None = None,  # power of two <= 64; chosen from shapes if None
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap); None or 0: off
) -> torch.Tensor:  # (B, H, D)
    check(query.dim() == 3, f"query must be (B, H, D), got {tuple(query.shape)}")
    check(k_cache.dim() == 4, f"k_cache must be (num_blocks, block_size, Hkv, D), got {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    check(v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check(cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != query head_dim {head_dim}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    check(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"block_tables must be ({num_seqs}, max_blocks), got {tuple(block_tables.shape)}",
    )
    check(block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}")
    check(context_lens.shape == (num_seqs,), f"context_lens must be ({num_seqs},), got {tuple(context_lens.shape)}")
    check(context_lens.dtype in (torch.int32, torch.int64), f"context_lens must be int32/int64, got {context_lens.dtype}")
    check(query.dtype in FLOAT_DTYPES, f"query dtype {query.dtype} not in {FLOAT_DTYPES}")
    check(k_cache.dtype in (query.dtype, FP8_KV_DTYPE) and v_cache.dtype == k_cache.dtype, f"cache dtype {k_cache.dtype} != query {query.dtype} (or float8_e4m3fn)")
    check(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}")
    check(logits_soft_cap is None or logits_soft_cap >= 0, f"logits_soft_cap must be >= 0, got {logits_soft_cap}")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    check(context_lens.is_contiguous(), "context_lens must be contiguous")
    if k_cache.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    check_same_device(query=query, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)
    if out is None:
        out = torch.empty_like(query)
    check(out.shape == query.shape and out.dtype == query.dtype, f"out must be {tuple(query.shape)} {query.dtype}")
    check_last_dim_contiguous("out", out)
    if num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    tiles = tile_config(head_dim, group, query.dtype)
    block_n = tiles["BLOCK_N"]
    if num_splits is None:
        num_splits = _pick_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size, block_n, query.device)
    check(
        1 <= num_splits <= _MAX_SPLITS and num_splits == next_pow2(num_splits),
        f"num_splits must be a power of two in [1, {_MAX_SPLITS}], got {num_splits}",
    )
    if num_splits > 1:
        part_out = _workspace((num_seqs, num_heads, num_splits, head_dim), query.device)
        part_lse = _workspace((num_seqs, num_heads, num_splits), query.device)
    else:  # unused: the split kernel writes `out` directly
        part_out = part_lse = out
    dot_fp32, precision = dot_args(query.dtype)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        scale * k_scale * _LOG2E,
        v_scale,
        sliding_window or 0,
        (logits_soft_cap or 1.0) * _LOG2E,
        block_size,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=bool(logits_soft_cap),
        DOT_FP32=dot_fp32,
        PRECISION=precision,
        **tiles,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            context_lens,
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=tiles["BLOCK_D"],
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
        )
    return out
