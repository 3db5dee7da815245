"""Python entry point of paged_decode_attention.c (float32 query, float32 or FP8 E4M3 cache):
argument checks, then one ctypes call.

`paged_decode_attention` has reference.py's signature and semantics (its twin); `kernels/ops.py`
calls it for CPU float32 queries when `common.supports()`. The C code trusts its indices, so
everything that could make it read or write outside a tensor is checked here first.
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu.common import _check_paged, _checked_library, _is_fp8, _raise_for_status


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # (H,) attention sinks (gpt-oss)
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap); None or 0: off
) -> torch.Tensor:  # (B, H, D)
    lib = _checked_library()
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = _check_paged(query, k_cache, v_cache)
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"{num_seqs} queries but block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)}"
        )
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    # The C code checks every length and block id it will use before reading (return 2, 3).
    args = (
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window or 0,
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
        status = lib.stoker_paged_decode_attention_fp8(*args, k_scale, v_scale, torch.get_num_threads(), sinks_ptr, soft_cap)
    else:
        status = lib.stoker_paged_decode_attention_f32(*args, torch.get_num_threads(), sinks_ptr, soft_cap)
    _raise_for_status(
        status, "paged_decode_attention",
        f"context_lens must be in [0, {block_tables.shape[1] * block_size}] (the block table's "
        f"{block_tables.shape[1]} blocks of {block_size})", num_blocks,
    )  # fmt: skip
    return out
