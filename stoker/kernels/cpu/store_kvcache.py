"""Python entry point of store_kvcache.c (float32 K/V into a float32 or FP8 E4M3 cache):
argument checks, then one ctypes call.

`store_kvcache` has reference.py's signature and semantics (its twin); `kernels/ops.py` calls
it when `store_supported()`. The C code trusts its indices, so everything that could make it
read or write outside a tensor is checked here first.
"""

from __future__ import annotations

import torch

from stoker.kernels._common import kv_inverse_scales
from stoker.kernels.cpu.build import library
from stoker.kernels.cpu.common import KV_DTYPES, _head_rows, _is_fp8, _threads, supports_rows


def store_supported(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C store's domain: CPU float32 K/V rows into a float32 or FP8 cache."""
    return supports_rows(key, value) and k_cache.dtype in KV_DTYPES and k_cache.device.type == "cpu"


def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = not stored
    k_scale: float = 1.0,  # FP8 caches: x is stored as e4m3(clamp(x / scale, +-448))
    v_scale: float = 1.0,
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k, k_stride = _head_rows(key, "key")
    v, v_stride = _head_rows(value, "value")
    if k.shape[1:] != (num_kv_heads, head_dim) or v.shape != k.shape or slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"key {tuple(k.shape)}, value {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
            f"do not fit the cache {tuple(k_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("k_cache and v_cache must be contiguous (num_blocks, block_size, Hkv, D)")
    if not (k.dtype == v.dtype == torch.float32 and k_cache.dtype in KV_DTYPES and v_cache.dtype == k_cache.dtype):
        raise ValueError(f"float32 K/V into a float32 or fp8 cache only: key {k.dtype}, value {v.dtype}, cache {k_cache.dtype}")
    slots = slot_mapping.to(torch.int64).contiguous()
    args = (
        k.data_ptr(), k_stride, v.data_ptr(), v_stride, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        k.shape[0], num_kv_heads * head_dim, num_blocks * block_size,
    )  # fmt: skip
    if _is_fp8(k_cache):
        bad = library().stoker_store_kvcache_fp8(*args, *kv_inverse_scales(k_scale, v_scale), _threads(k.numel()))
    else:
        bad = library().stoker_store_kvcache_f32(*args, _threads(k.numel()))
    if bad:
        raise ValueError(f"{bad} slot_mapping entries are past the cache's {num_blocks * block_size} slots")
