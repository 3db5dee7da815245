"""The kernel entry points the model layers call, each with reference.py's signature.

CPU float32 tensors take the C kernels in `kernels/cpu/` (paged decode and prefill
attention over float32 or FP8 caches, K/V stores, RMSNorm, SiLU-and-mul, rotary) when they build (a C compiler is present) and `STOKER_DISABLE_CPU_KERNELS` is
unset; other CPU tensors take the plain-torch twins in `reference.py`. CUDA tensors take the Triton
kernel when triton imports and `STOKER_DISABLE_TRITON` is unset (or "0"); otherwise the
twin. Projections are not dispatched here: their weight method binds its kernel when the
model is built (layers/backends.py). The kernel modules import triton at their top, so they are imported here only on the
first CUDA call: `import stoker.kernels.ops` works on a machine without triton.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from stoker.kernels import reference
from stoker.kernels.cpu import common as cpu_common
from stoker.kernels.cpu import elementwise as cpu_elementwise
from stoker.kernels.cpu import paged_decode_attention as cpu_decode
from stoker.kernels.cpu import prefill_attention as cpu_prefill
from stoker.kernels.cpu import store_kvcache as cpu_store


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing driver libraries, ...)
        return False
    return True


def triton_disabled() -> bool:
    """STOKER_DISABLE_TRITON=1 forces the torch twins (read per call: tests may flip it)."""
    return os.environ.get("STOKER_DISABLE_TRITON", "0").strip().lower() not in ("", "0", "false", "no")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not triton_disabled() and triton_available()


@functools.cache
def _kernel(module: str) -> ModuleType:
    return importlib.import_module(f"stoker.kernels.{module}")


def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64
    k_scale: float = 1.0,  # FP8 caches: x is stored as e4m3(clamp(x / scale, +-448))
    v_scale: float = 1.0,
) -> None:
    if use_triton(key):
        return _kernel("store_kvcache").store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if cpu_store.store_supported(key, value, k_cache):
        return cpu_store.store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks)
    context_lens: torch.Tensor,  # (B,)
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
) -> torch.Tensor:  # (B, H, D)
    args = (query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
    if use_triton(query):
        return _kernel("paged_decode_attention").paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    if cpu_common.supports(query, k_cache):
        return cpu_decode.paged_decode_attention(*args, k_scale, v_scale)
    return reference.paged_decode_attention(*args, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,  # (T, H, D), packed over sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks)
    cu_seqlens_q: list[int] | torch.Tensor,  # (B + 1,)
    context_lens: list[int] | torch.Tensor,  # (B,)
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
) -> torch.Tensor:  # (T, H, D)
    args = (query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, sliding_window)
    if use_triton(query):
        return _kernel("paged_prefill_attention").paged_attention(*args, k_scale=k_scale, v_scale=v_scale)
    if cpu_prefill.prefill_supported(query, k_cache):
        return cpu_prefill.paged_attention(*args, k_scale, v_scale)
    return reference.paged_attention(*args, k_scale, v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _kernel("rms_norm").rms_norm(x, weight, eps)
    if cpu_common.supports_rows(x, weight):
        return cpu_elementwise.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _kernel("rms_norm").fused_add_rms_norm(x, residual, weight, eps)
    if cpu_common.supports_rows(x, residual, weight):
        return cpu_elementwise.fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return _kernel("activation").silu_and_mul(x)
    if cpu_common.supports_rows(x):
        return cpu_elementwise.silu_and_mul(x)
    return reference.silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, Hkv, D)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim) float32
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(query):
        return _kernel("rotary").rotary_embedding(positions, query, key, cos_sin_cache)
    if cpu_common.supports_rows(query, key, cos_sin_cache):
        return cpu_elementwise.rotary_embedding(positions, query, key, cos_sin_cache)
    return reference.rotary_embedding(positions, query, key, cos_sin_cache)


__all__ = [
    "store_kvcache",
    "paged_attention",
    "paged_decode_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "triton_available",
    "use_triton",
]
