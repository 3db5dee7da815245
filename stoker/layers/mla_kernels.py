"""The latent cache's paged operations for multi-head latent attention (layers/mla_attention.py):
storing a step's latent rows (float or FP8), reading a sequence's rows back, and the absorbed
decode kernel the layer runs, chosen once from the kernel set the model builder binds.

An FP8 cache (`--kv-cache-dtype fp8`, float8_e4m3fn) stores each row element x as
e4m3(clamp(x / k_scale, +-448)), the dense FP8 path's rule (kernels/reference.store_kvcache)
with the layer's one scale (k_scale: the latent is the key and, in its first kv_lora_rank
values, the value), and reads it back as value x k_scale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from stoker.kernels import reference
from stoker.kernels._common import FP8_KV_DTYPE, FP8_MAX, kv_inverse_scales

DecodeKernel = Callable[..., torch.Tensor]  # reference.mla_decode_attention's signature


def store_latents(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, k_scale: float) -> None:
    """rows (T, r + R) into cache (num_blocks, block_size, 1, r + R) at slots (T,) int64 (-1:
    a padding token, not stored)."""
    valid = slots >= 0
    if not bool(valid.all()):
        rows, slots = rows[valid], slots[valid]
    flat = cache.view(-1, cache.shape[-1])  # (num_slots, r + R)
    if cache.dtype == FP8_KV_DTYPE:
        inv, _ = kv_inverse_scales(k_scale, k_scale)
        # index_copy_ has no float8 kernel: the bytes are copied as uint8
        q = (rows.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE).view(torch.uint8)
        flat.view(torch.uint8).index_copy_(0, slots, q)
        return
    flat.index_copy_(0, slots, rows.to(cache.dtype))


def gather_latents(cache: torch.Tensor, block_table: torch.Tensor, context_len: int, k_scale: float = 1.0) -> torch.Tensor:
    """One sequence's latent rows: cache (num_blocks, bs, 1, D), block_table (max_blocks,) ->
    (context_len, D), dequantized to float32 from an FP8 cache."""
    bs = cache.shape[1]
    blocks = block_table[: -(-context_len // bs)].long()
    rows = cache[blocks].reshape(-1, cache.shape[-1])[:context_len]
    return reference.dequantize_kv(rows, k_scale, torch.float32) if cache.dtype == FP8_KV_DTYPE else rows


@functools.cache
def _triton_decode() -> DecodeKernel:
    from stoker.kernels.mla_decode_attention import mla_decode_attention

    return mla_decode_attention


def decode_kernel(kernels_name: str) -> DecodeKernel:
    """The absorbed decode for a layer bound the kernel set `kernels_name`
    (kernels/ops.select: once, at build): Triton on CUDA, the C kernel for CPU float32 (its
    cache float32 or FP8), else the torch twin."""
    if kernels_name == "triton":
        return _triton_decode()
    if kernels_name == "cpu":
        from stoker.kernels.cpu.mla_decode_attention import mla_decode_attention

        return mla_decode_attention
    return reference.mla_decode_attention


def decode_query_dtype(kernels_name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the absorbed queries go to the kernel in: the model's on the GPU (tensor-core
    dot products against the cache's rows), float32 for the C kernel and the twin."""
    return model_dtype if kernels_name == "triton" else torch.float32
