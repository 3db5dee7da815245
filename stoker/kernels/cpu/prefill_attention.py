"""Python entry points of prefill_attention.c (float32): argument checks, then one ctypes call.

`paged_attention` has reference.py's signature and semantics (its twin); `kernels/ops.py` calls
it for CPU float32 queries when `prefill_supported()`. `varlen_attention` and
`encoder_attention` are the pooling models' attention over packed sequences with no KV cache
(pooling/attention.py). The C code trusts its indices, so everything that could make it read
or write outside a tensor is checked here first.
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu.build import library
from stoker.kernels.cpu.common import (
    _check_paged,
    _check_varlen_tables,
    _checked_library,
    _is_fp8,
    _raise_for_status,
    supports,
)


def vector_width() -> int:
    """Floats per vector register of this build (a head_dim the prefill kernel takes is a multiple)."""
    return int(library().stoker_linear_vl())


def prefill_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C prefill kernel's domain: CPU float32, head_dim a multiple of the vector width."""
    return supports(query, k_cache) and query.shape[-1] % vector_width() == 0


def paged_attention(
    query: torch.Tensor,  # (T, H, D), packed over sequences
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: list[int] | torch.Tensor,  # (B + 1,)
    context_lens: list[int] | torch.Tensor,  # (B,)
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # (H,) attention sinks (gpt-oss)
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap); None or 0: off
) -> torch.Tensor:  # (T, H, D)
    """reference.paged_attention's semantics, in C (prefill_attention.c)."""
    lib = _checked_library()
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = _check_paged(query, k_cache, v_cache)
    cu = torch.as_tensor(cu_seqlens_q, dtype=torch.int64).contiguous()
    ctx = torch.as_tensor(context_lens, dtype=torch.int64).contiguous()
    num_seqs = ctx.shape[0]
    if cu.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q {tuple(cu.shape)}, context_lens {tuple(ctx.shape)} and block_tables disagree")
    if num_seqs and (int(cu[0]) < 0 or int(cu[-1]) > num_tokens or bool((cu[1:] < cu[:-1]).any())):
        raise ValueError(f"cu_seqlens_q must rise from >= 0 to <= {num_tokens} (the query rows)")
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    args = (
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_tables.data_ptr(),
        block_tables.shape[1], cu.data_ptr(), ctx.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads,
        head_dim, block_size, scale, sliding_window or 0,
    )  # fmt: skip
    sinks_ptr = None  # NULL: no sinks
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks {tuple(sinks.shape)}: one per query head ({num_heads})")
        sinks = sinks.to(torch.float32).contiguous()
        sinks_ptr = sinks.data_ptr()
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be positive (or None: off), got {logits_soft_cap}")
    soft_cap = float(logits_soft_cap or 0.0)  # 0: off
    if _is_fp8(k_cache):
        status = lib.stoker_paged_prefill_attention_fp8(*args, k_scale, v_scale, torch.get_num_threads(), sinks_ptr, soft_cap)
    else:
        status = lib.stoker_paged_prefill_attention_f32(*args, torch.get_num_threads(), sinks_ptr, soft_cap)
    _raise_for_status(
        status, "paged_attention",
        f"each sequence needs 0 <= query rows <= context_len <= the block table's {block_tables.shape[1] * block_size} positions",
        num_blocks,
    )  # fmt: skip
    return out


def varlen_attention(
    query: torch.Tensor,  # (T, H, D) packed over sequences, contiguous
    key: torch.Tensor,  # (T, Hkv, D) contiguous
    value: torch.Tensor,  # (T, Hkv, D) contiguous
    token_table: torch.Tensor,  # (B, max_len) int32: row s = the token rows of sequence s (then anything)
    cu_seqlens: torch.Tensor,  # (B + 1,) int64
    lengths: torch.Tensor,  # (B,) int64
    scale: float,
    causal: bool,
) -> torch.Tensor:  # (T, H, D)
    """Attention of whole packed sequences with no KV cache (pooling models), each sequence over
    its own tokens only, with no padding: prefill_attention.c reading `key`/`value` as a cache
    of block_size 1 whose block table is each sequence's token rows; bidirectional (an encoder)
    or causal (a decoder embedding model). Semantics: SDPA per sequence."""
    lib = _checked_library()
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        raise ValueError("varlen_attention needs contiguous query, key and value")
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} do not match")
    if token_table.dtype != torch.int32 or cu_seqlens.dtype != torch.int64 or lengths.dtype != torch.int64:
        raise ValueError("token_table must be int32, cu_seqlens and lengths int64")
    num_seqs = lengths.shape[0]
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    args = (
        query.data_ptr(), key.data_ptr(), value.data_ptr(), num_tokens, token_table.data_ptr(), token_table.shape[1],
        cu_seqlens.data_ptr(), lengths.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, 1, scale,
    )  # fmt: skip
    if causal:
        status = lib.stoker_paged_prefill_attention_f32(*args, 0, torch.get_num_threads(), None, 0.0)
    else:
        status = lib.stoker_prefill_attention_bidirectional_f32(*args, torch.get_num_threads())
    _raise_for_status(status, "varlen_attention", "each sequence's length must fit its token_table row", num_tokens)
    return out


def encoder_attention(
    qkv: torch.Tensor,  # (T, 3, H, D) an encoder's fused projection, contiguous
    token_table: torch.Tensor,  # (B, max_len) int32: row s = the token rows of sequence s
    cu_seqlens: torch.Tensor,  # (B + 1,) int64
    lengths: torch.Tensor,  # (B,) int64
    scale: float,
) -> torch.Tensor:  # (T, H, D)
    """varlen_attention, not causal, reading q, k and v in place from one fused projection
    (prefill_attention.c, stoker_encoder_attention_f32): no copy of each."""
    num_tokens, three, num_heads, head_dim = qkv.shape
    if three != 3 or qkv.dtype != torch.float32 or not qkv.is_contiguous():
        raise ValueError(f"encoder_attention needs contiguous float32 (T, 3, H, D), got {tuple(qkv.shape)} {qkv.dtype}")
    _check_varlen_tables(token_table, cu_seqlens, lengths, num_tokens)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
    if lengths.shape[0]:
        status = _checked_library().stoker_encoder_attention_f32(
            qkv.data_ptr(), num_tokens, token_table.data_ptr(), token_table.shape[1], cu_seqlens.data_ptr(),
            lengths.data_ptr(), out.data_ptr(), lengths.shape[0], num_heads, head_dim, scale, torch.get_num_threads(),
        )  # fmt: skip
        _raise_for_status(status, "encoder_attention", "each sequence's length must fit its token_table row", num_tokens)
    return out
