"""Absorbed multi-head latent attention decode (DeepSeek-V2/V3 MLA) over a paged latent cache.

Twin: `reference.mla_decode_attention` (the C kernel kernels/cpu/mla_decode_attention.c is its
CPU counterpart).

Each sequence's one query token has, per head, a query of kv_lora_rank + rope values: the nope
part already folded into latent space by W_UK, then the rotated q_pe. Every cached row is
[latent (kv_lora_rank) | rotated rope key (rope)], shared by all heads: the whole row is the key,
its latent part the value, and the output stays in latent space (W_UV is applied after):
    out[b, h, :] = softmax_l(scale * q[b, h] . row_l) @ row_l[:kv_lora_rank]
One program owns BLOCK_H heads of one sequence (the rows of a tl.dot), so each latent row is
read once per BLOCK_H heads, not once per head; the latent and rope parts are separate tiles
(512 and 64 in V3: each a power of two, where their 576 sum is not). At small batch the context
is cut into NUM_SPLITS partitions (flash-decoding) and paged_decode_attention's reduce kernel
combines them; the partition size follows each sequence's own length inside the kernel, so the
launch depends on shapes only.
FP8 caches (float8_e4m3fn): tiles are widened to the query's dtype as they are loaded; k_scale
joins the softmax scale and multiplies the output (the value is the key's latent part).
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
from stoker.kernels.paged_decode_attention import _decode_reduce_kernel

_LOG2E = 1.4426950408889634
# The reduce holds a (NUM_SPLITS, kv_lora_rank) float32 tile: 16 x 512 stays in registers on sm_90
_MAX_SPLITS = 16


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,  # (B, H, RANK + ROPE)
    cache_ptr,  # (num_blocks, block_size, 1, RANK + ROPE): [latent | k_pe] rows
    block_tables_ptr,  # (B, max_blocks) int32
    context_lens_ptr,  # (B,)
    out_ptr,  # (B, H, RANK) float32: written directly when NUM_SPLITS == 1
    part_out_ptr,  # (B, H, NUM_SPLITS, RANK) float32: each split's normalised output
    part_lse_ptr,  # (B, H, NUM_SPLITS) float32: each split's log2-sum-exp2 of scores
    scale_log2,  # softmax scale * k_scale * log2(e)
    v_scale,  # FP8 caches: k_scale, multiplies the output (1.0 otherwise)
    num_heads,
    block_size,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program, >= 16 (tl.dot's minimum)
    BLOCK_R: tl.constexpr,  # RANK padded to a power of two
    BLOCK_P: tl.constexpr,  # ROPE padded to a power of two
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # Equal partitions of this sequence's context in whole BLOCK_N steps (as the reduce computes them)
    part = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * part
    if NUM_SPLITS > 1:
        if start >= ctx_len:  # no tokens here; the reduce never reads this split
            return
    end = tl.minimum(start + part, ctx_len)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    h_mask = h < num_heads
    r_mask = r < RANK
    p_mask = p < ROPE
    q_row = q_ptr + seq * stride_qb + h[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # (BLOCK_H, BLOCK_R)
    q_pe = tl.load(q_row + RANK + p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)  # (BLOCK_H, BLOCK_P)
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    # Online softmax; m starts finite so an all-masked step gives exp2(-inf - m) = 0, not NaN
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for step in range(start, end, BLOCK_N):
        pos = step + n  # (BLOCK_N,)
        valid = pos < end
        page = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
        row = cache_ptr + page.to(tl.int64)[:, None] * stride_cb + (pos % block_size)[:, None] * stride_cs
        c = tl.load(row + r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0).to(q_lat.dtype)  # (N, R)
        k_pe = tl.load(row + RANK + p[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0).to(q_pe.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # (BLOCK_H, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new

    has_any = l_i > 0  # false only for an empty context
    out = acc * v_scale / tl.where(has_any, l_i, 1.0)[:, None]  # (BLOCK_H, BLOCK_R)
    out_mask = h_mask[:, None] & r_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ob + h[:, None] * stride_oh + r[None, :], out, mask=out_mask)
    else:
        slot = (seq * num_heads + h) * NUM_SPLITS + split  # (BLOCK_H,)
        tl.store(part_out_ptr + slot[:, None] * RANK + r[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + slot, tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf")),
                 mask=h_mask)


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Split buffers; fully rewritten where read (tests swap in a NaN-filled one to check)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def tile_config(kv_lora_rank: int, rope: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and warps of the split kernel, chosen so that ptxas reports no register spills
    for sm_90 (tests/kernels/aot_sm90.py): a K step of BLOCK_N x BLOCK_R 16-bit elements (half
    as many float32) and the (16, BLOCK_R) float32 accumulator over 8 warps. Not yet tuned on a GPU."""
    block_r = next_pow2(kv_lora_rank)
    budget = 8192 if dtype == torch.float32 else 16384
    return {
        "BLOCK_H": 16,
        "BLOCK_R": block_r,
        "BLOCK_P": max(16, next_pow2(rope)),  # tl.dot's K dimension >= 16
        "BLOCK_N": max(16, min(64, budget // block_r)),
        "num_warps": 8,
    }


def pick_num_splits(num_seqs: int, num_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Enough splits that the programs give every SM about two, from shapes only; a power of two
    so that at most log2(_MAX_SPLITS) + 1 variants get compiled."""
    programs = num_seqs * triton.cdiv(num_heads, 16)
    want = triton.cdiv(2 * num_sms(device.index if device.type == "cuda" else None), programs)
    splits = max(1, min(want, triton.cdiv(max_context, 4 * block_n), _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def mla_decode_attention(
    query: torch.Tensor,  # (B, H, kv_lora_rank + rope): W_UK-absorbed nope part, then q_pe
    latent_cache: torch.Tensor,  # (num_blocks, block_size, 1, kv_lora_rank + rope)
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32/int64 (0 yields zeros)
    kv_lora_rank: int,
    scale: float,
    k_scale: float = 1.0,  # FP8 caches: a row element is e4m3 value x k_scale
    *,
    num_splits: int | None = None,  # power of two <= 16; chosen from shapes if None
) -> torch.Tensor:  # (B, H, kv_lora_rank) float32
    check(query.dim() == 3, f"query must be (B, H, kv_lora_rank + rope), got {tuple(query.shape)}")
    check(latent_cache.dim() == 4 and latent_cache.shape[2] == 1,
          f"latent_cache must be (num_blocks, block_size, 1, width), got {tuple(latent_cache.shape)}")
    num_seqs, num_heads, width = query.shape
    _, block_size, _, cache_width = latent_cache.shape
    check(cache_width == width, f"latent cache width {cache_width} != query width {width}")
    check(0 < kv_lora_rank < width, f"kv_lora_rank {kv_lora_rank} must be in (0, {width})")
    check(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
          f"block_tables must be ({num_seqs}, max_blocks), got {tuple(block_tables.shape)}")
    check(block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}")
    check(context_lens.shape == (num_seqs,), f"context_lens must be ({num_seqs},), got {tuple(context_lens.shape)}")
    check(context_lens.dtype in (torch.int32, torch.int64), f"context_lens must be int32/int64, got {context_lens.dtype}")
    check(context_lens.is_contiguous(), "context_lens must be contiguous")
    check(query.dtype in FLOAT_DTYPES, f"query dtype {query.dtype} not in {FLOAT_DTYPES}")
    check(latent_cache.dtype in (query.dtype, FP8_KV_DTYPE),
          f"latent cache dtype {latent_cache.dtype} != query {query.dtype} (or float8_e4m3fn)")
    for name, t in (("query", query), ("latent_cache", latent_cache), ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    check_same_device(query=query, latent_cache=latent_cache, block_tables=block_tables, context_lens=context_lens)
    if latent_cache.dtype != FP8_KV_DTYPE:
        k_scale = 1.0
    out = torch.empty(num_seqs, num_heads, kv_lora_rank, dtype=torch.float32, device=query.device)
    if num_seqs == 0:
        return out
    tiles = tile_config(kv_lora_rank, width - kv_lora_rank, query.dtype)
    if num_splits is None:
        num_splits = pick_num_splits(num_seqs, num_heads, block_tables.shape[1] * block_size, tiles["BLOCK_N"],
                                     query.device)
    check(1 <= num_splits <= _MAX_SPLITS and num_splits == next_pow2(num_splits),
          f"num_splits must be a power of two in [1, {_MAX_SPLITS}], got {num_splits}")
    if num_splits > 1:
        part_out = _workspace((num_seqs, num_heads, num_splits, kv_lora_rank), query.device)
        part_lse = _workspace((num_seqs, num_heads, num_splits), query.device)
    else:  # unused: the split kernel writes `out` directly
        part_out = part_lse = out
    dot_fp32, precision = dot_args(query.dtype)
    grid = (num_seqs, triton.cdiv(num_heads, tiles["BLOCK_H"]), num_splits)
    _mla_decode_split_kernel[grid](
        query, latent_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * k_scale * _LOG2E, k_scale, num_heads, block_size,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        RANK=kv_lora_rank, ROPE=width - kv_lora_rank, NUM_SPLITS=num_splits, DOT_FP32=dot_fp32, PRECISION=precision,
        **tiles,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            context_lens, part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=kv_lora_rank, BLOCK_D=tiles["BLOCK_R"], BLOCK_N=tiles["BLOCK_N"], NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out
