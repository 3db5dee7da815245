"""Python entry point of mla_decode_attention.c (float32 query; a float32 or FP8 E4M3 latent
cache): argument checks, then one ctypes call. Same signature and semantics as reference.py's
`mla_decode_attention` (its twin). The C code checks lengths and block ids before reading."""

from __future__ import annotations

import torch

from stoker.kernels.cpu.common import _checked_library, _is_fp8, _raise_for_status


def mla_decode_attention(
    query: torch.Tensor,  # (B, H, kv_lora_rank + rope): W_UK-absorbed nope part, then q_pe
    latent_cache: torch.Tensor,  # (num_blocks, block_size, 1, kv_lora_rank + rope)
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32
    kv_lora_rank: int,
    scale: float,
    k_scale: float = 1.0,  # FP8 caches: a row element is e4m3 value x k_scale
) -> torch.Tensor:  # (B, H, kv_lora_rank) float32
    lib = _checked_library()
    num_seqs, num_heads, width = query.shape
    num_blocks, block_size, one, cache_width = latent_cache.shape
    if one != 1 or cache_width != width or not 0 < kv_lora_rank <= width:
        raise ValueError(f"latent cache {tuple(latent_cache.shape)} does not match queries {tuple(query.shape)} "
                         f"with kv_lora_rank {kv_lora_rank}")
    fp8 = _is_fp8(latent_cache)
    if query.dtype != torch.float32 or not (fp8 or latent_cache.dtype == torch.float32) or not latent_cache.is_contiguous():
        raise ValueError("mla_decode_attention takes a float32 query and a contiguous float32 or float8_e4m3fn latent "
                         f"cache, got {query.dtype} and {latent_cache.dtype}")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"{num_seqs} queries but block_tables {tuple(block_tables.shape)} and "
                         f"context_lens {tuple(context_lens.shape)}")
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_heads, kv_lora_rank, dtype=torch.float32)
    if num_seqs == 0:
        return out
    args = (query.data_ptr(), latent_cache.data_ptr(), num_blocks, block_tables.data_ptr(), block_tables.shape[1],
            context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, width, kv_lora_rank, block_size, scale)
    if fp8:
        status = lib.stoker_mla_decode_attention_fp8(*args, k_scale, torch.get_num_threads())
    else:
        status = lib.stoker_mla_decode_attention_f32(*args, torch.get_num_threads())
    _raise_for_status(
        status, "mla_decode_attention",
        f"context_lens must be in [0, {block_tables.shape[1] * block_size}] (the block table's "
        f"{block_tables.shape[1]} blocks of {block_size})", num_blocks,
    )  # fmt: skip
    return out
