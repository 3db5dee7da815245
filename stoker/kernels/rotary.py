"""Rotary position embedding (Su et al. 2021, RoFormer), GPT-NeoX layout, one token per program.

Twin: `reference.rotary_embedding`. The first rot_dim dims of each head are split into halves
(x1, x2) and rotated by the angle of the token's position: (x1 cos - x2 sin, x2 cos + x1 sin);
dims past rot_dim (partial rotary) are copied. cos/sin come precomputed from a
(max_position, rot_dim) [cos | sin] cache, so every scaling (linear, llama3, yarn, ...) is the
cache builder's business (layers/rotary.py) and this kernel serves them all unchanged.
Query and key are handled by the same program, so positions and cos/sin are read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import FLOAT_DTYPES, check, check_last_dim_contiguous, check_same_device, next_pow2


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_st, stride_sh, stride_dt, stride_dh, token, cos, sin,
    num_heads, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # cos, sin: (1, BLOCK_HALF) float32 for this token.
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < HALF)
    src = src_ptr + token * stride_st + h * stride_sh
    dst = dst_ptr + token * stride_dt + h * stride_dh
    x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_HALF)
    x2 = tl.load(src + HALF + j, mask=mask, other=0.0).to(tl.float32)
    if BLOCK_PASS > 0:  # partial rotary: dims [2 * HALF, HEAD_DIM) pass through
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        p_mask = (h < num_heads) & (p < HEAD_DIM)
        passed = tl.load(src + p, mask=p_mask)
    # Loads above complete before any store, so dst may alias src (in-place rotation).
    tl.store(dst + j, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + j, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        tl.store(dst + p, passed, mask=p_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # (T,)
    q_ptr,  # (T, H, D)
    k_ptr,  # (T, Hkv, D)
    q_out_ptr,
    k_out_ptr,
    cos_sin_ptr,  # (max_position, rot_dim): [cos | sin]
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,  # rot_dim / 2
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # 0 when rot_dim == head_dim
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin,
                  num_heads, HALF, HEAD_DIM, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin,
                  num_kv_heads, HALF, HEAD_DIM, BLOCK_HKV, BLOCK_HALF, BLOCK_PASS)


def rotary_embedding(
    positions: torch.Tensor,  # (T,) int32/int64, each < max_position (not checked: no host sync)
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, Hkv, D)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim) float32 [cos | sin]; rot_dim even, <= D
    *,
    query_out: torch.Tensor | None = None,  # (T, H, D); may be `query` itself (in place)
    key_out: torch.Tensor | None = None,  # (T, Hkv, D); may be `key` itself
) -> tuple[torch.Tensor, torch.Tensor]:
    check(query.dim() == 3 and key.dim() == 3, f"query/key must be 3-D, got {tuple(query.shape)}, {tuple(key.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    check(key.shape[0] == num_tokens and key.shape[2] == head_dim, f"key {tuple(key.shape)} vs query {tuple(query.shape)}")
    check(positions.shape == (num_tokens,), f"positions must be ({num_tokens},), got {tuple(positions.shape)}")
    check(positions.dtype in (torch.int32, torch.int64), f"positions must be int32/int64, got {positions.dtype}")
    check(cos_sin_cache.dim() == 2, f"cos_sin_cache must be (max_position, rot_dim), got {tuple(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    check(rot_dim % 2 == 0 and 0 < rot_dim <= head_dim, f"rot_dim {rot_dim} must be even and in (0, {head_dim}]")
    check(cos_sin_cache.dtype in FLOAT_DTYPES, f"cos_sin_cache dtype {cos_sin_cache.dtype} (float32 expected)")
    check(query.dtype in FLOAT_DTYPES and key.dtype in FLOAT_DTYPES, f"dtypes query {query.dtype}, key {key.dtype}")
    check(positions.is_contiguous() and cos_sin_cache.stride(1) == 1, "positions and cos_sin_cache rows must be contiguous")
    for name, t in (("query", query), ("key", key)):
        check_last_dim_contiguous(name, t)
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    if query_out is None:
        query_out = torch.empty_like(query)
    if key_out is None:
        key_out = torch.empty_like(key)
    check(query_out.shape == query.shape and query_out.dtype == query.dtype, "query_out must match query")
    check(key_out.shape == key.shape and key_out.dtype == key.dtype, "key_out must match key")
    check_last_dim_contiguous("query_out", query_out)
    check_last_dim_contiguous("key_out", key_out)
    if num_tokens == 0:
        return query_out, key_out
    half = rot_dim // 2
    num_pass = head_dim - rot_dim
    _rotary_kernel[(num_tokens,)](
        positions, query, key, query_out, key_out, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        key.shape[1],
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_HKV=next_pow2(key.shape[1]),
        BLOCK_HALF=next_pow2(half),
        BLOCK_PASS=next_pow2(num_pass) if num_pass else 0,
    )
    return query_out, key_out
