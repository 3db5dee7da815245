"""Paged prefill / extend attention over packed variable-length sequences (causal).

Twin: `reference.paged_attention`.

Every key and value is read from the paged cache through the block table, the step's own
tokens included (store_kvcache runs first), so a sequence whose prefix is a prefix-cache hit,
or whose earlier chunks were prefilled in previous steps, needs nothing special: its query
tokens simply sit at positions context_len - q_len + i.

Work split: a program owns a tile of BLOCK_Q query tokens of one sequence and one KV head;
its BLOCK_M = BLOCK_Q * GROUP rows are (token, query head) pairs for the GROUP query heads
sharing that KV head, so each K/V tile it loads serves all of them (GQA read once).
The grid is shaped from T and B alone, never from per-sequence lengths: sequence s owns tiles
[cu[s] // BLOCK_Q + s, cu[s + 1] // BLOCK_Q + s + 1), which covers its cdiv(q_len, BLOCK_Q)
tiles, and a program finds its sequence by counting tile starts <= its id. No host sync.
Logit soft-capping (Gemma 2, USE_SOFT_CAP) as in the decode kernel: each score bent to
cap x tanh(score / cap) before the causal / window mask.
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
)
from stoker.kernels.paged_decode_attention import soft_cap

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # (T, H, D)
    k_cache_ptr,  # (num_blocks, block_size, Hkv, D)
    v_cache_ptr,
    out_ptr,  # (T, H, D)
    block_tables_ptr,  # (B, max_blocks) int32
    cu_seqlens_q_ptr,  # (B + 1,) int32
    context_lens_ptr,  # (B,) int32
    scale_log2,  # softmax scale * k_scale * log2(e)
    v_scale,  # FP8 caches: multiplies the output (1.0 otherwise)
    num_seqs,
    window,  # sliding window in tokens (used when USE_WINDOW)
    cap_log2,  # logit soft cap x log2(e) (used when USE_SOFT_CAP)
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,  # rows = (token, head-in-group) pairs
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,  # num_seqs padded to a power of two
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Which sequence owns this tile (see the module docstring for the tile ranges).
    b = tl.arange(0, BLOCK_B)
    cu = tl.load(cu_seqlens_q_ptr + b, mask=b < num_seqs, other=0)
    first_tiles = cu // BLOCK_Q + b  # (BLOCK_B,) non-decreasing; first_tiles[0] == 0
    seq = tl.sum(((first_tiles <= tile) & (b < num_seqs)).to(tl.int32), 0) - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_tok = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query token of this tile
    if first_tok >= q_len:  # spare tile of this sequence
        return
    ctx_len = tl.load(context_lens_ptr + seq)
    prefix_len = ctx_len - q_len  # cached tokens before this step's queries

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    tok = first_tok + r // GROUP  # (BLOCK_M,) query token index within the sequence
    heads = kv_head * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (tok < q_len)
    d_mask = d < HEAD_DIM
    q_pos = prefix_len + tok  # (BLOCK_M,) absolute positions
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys this tile can see: [lo, hi), causal up to its last token, window back from its first.
    hi = prefix_len + tl.minimum(first_tok + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix_len + first_tok - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: all-masked steps stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kv_head * stride_ch + d[None, :]
    for step in range(lo, hi, BLOCK_N):
        pos = step + n  # (BLOCK_N,) key positions
        in_range = pos < hi
        page = tl.load(bt_row + pos // block_size, mask=in_range, other=0)
        offs = page.to(tl.int64)[:, None] * stride_cb + (pos % block_size)[:, None] * stride_cs + kv_base
        kv_mask = in_range[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N)
        if USE_SOFT_CAP:
            s = soft_cap(s, cap_log2)
        allowed = pos[None, :] <= q_pos[:, None]  # causal (for valid rows this implies pos < hi)
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Every valid row sees at least its own position, so l_i > 0 there; padding rows are not stored.
    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


def tile_config(head_dim: int, group: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and warps chosen so that ptxas reports no register spills for sm_90
    (checked without a GPU by tests/kernels/test_kernel_compile_sm90.py); bigger row tiles
    reuse each K/V tile more, the per-element gather pointers and float32 operands cost
    registers. Not yet tuned on a GPU."""
    block_d = next_pow2(head_dim)
    if dtype == torch.float32:
        block_m, block_n = (64 if block_d <= 128 else 32), 16
    else:
        block_m, block_n = (128, 64) if block_d <= 64 else (128, 32) if block_d <= 128 else (64, 16)
    block_m = max(block_m, next_pow2(group))  # at least one token's whole head group
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "BLOCK_N": block_n, "BLOCK_D": block_d, "num_warps": 8}


def _as_int32(x: list[int] | torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        check(x.dim() == 1, f"{name} must be 1-D, got {tuple(x.shape)}")
        check(x.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64, got {x.dtype}")
        return x.to(device=device, dtype=torch.int32).contiguous()
    return torch.tensor([int(v) for v in x], dtype=torch.int32, device=device)


def paged_attention(
    query: torch.Tensor,  # (T, H, D), packed over sequences
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: list[int] | torch.Tensor,  # (B + 1,) query offsets into T
    context_lens: list[int] | torch.Tensor,  # (B,) cached + new tokens per sequence
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,  # (T, H, D) in query's dtype; allocated if None
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap); None or 0: off
) -> torch.Tensor:  # (T, H, D); rows past cu_seqlens_q[-1] are left untouched
    check(query.dim() == 3, f"query must be (T, H, D), got {tuple(query.shape)}")
    check(k_cache.dim() == 4, f"k_cache must be (num_blocks, block_size, Hkv, D), got {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    check(v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check(cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != query head_dim {head_dim}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    check(block_tables.dim() == 2, f"block_tables must be (B, max_blocks), got {tuple(block_tables.shape)}")
    check(block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}")
    num_seqs = block_tables.shape[0]
    cu = _as_int32(cu_seqlens_q, query.device, "cu_seqlens_q")
    ctx = _as_int32(context_lens, query.device, "context_lens")
    check(cu.shape == (num_seqs + 1,), f"cu_seqlens_q must have B + 1 = {num_seqs + 1} entries, got {cu.shape[0]}")
    check(ctx.shape == (num_seqs,), f"context_lens must have B = {num_seqs} entries, got {ctx.shape[0]}")
    check(query.dtype in FLOAT_DTYPES, f"query dtype {query.dtype} not in {FLOAT_DTYPES}")
    check(k_cache.dtype in (query.dtype, FP8_KV_DTYPE) and v_cache.dtype == k_cache.dtype, f"cache dtype {k_cache.dtype} != query {query.dtype} (or float8_e4m3fn)")
    check(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}")
    check(logits_soft_cap is None or logits_soft_cap >= 0, f"logits_soft_cap must be >= 0, got {logits_soft_cap}")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    check_same_device(query=query, k_cache=k_cache, block_tables=block_tables)
    if k_cache.dtype != FP8_KV_DTYPE:
        k_scale = v_scale = 1.0
    if out is None:
        out = torch.empty_like(query)
    check(out.shape == query.shape and out.dtype == query.dtype, f"out must be {tuple(query.shape)} {query.dtype}")
    check_last_dim_contiguous("out", out)
    if num_seqs == 0 or num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    tiles = tile_config(head_dim, group, query.dtype)
    block_q = tiles["BLOCK_Q"]
    dot_fp32, precision = dot_args(query.dtype)
    # Tiles: sum over s of (cu[s+1] // BLOCK_Q - cu[s] // BLOCK_Q + 1) = T // BLOCK_Q + B at most.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu,
        ctx,
        scale * k_scale * _LOG2E,
        v_scale,
        num_seqs,
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
        BLOCK_B=next_pow2(num_seqs),
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=bool(logits_soft_cap),
        DOT_FP32=dot_fp32,
        PRECISION=precision,
        **tiles,
    )
    return out
