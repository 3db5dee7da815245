"""The kernel sets the layers run on, and the dispatching entry points for tests and tools.

Three sets, each with reference.py's signatures:

  * `triton`: the Triton kernels, for CUDA tensors when triton imports and
    `STOKER_DISABLE_TRITON` is unset (or "0");
  * `cpu`: the C kernels in `kernels/cpu/` (paged decode and prefill attention over float32 or
    FP8 caches, K/V stores, RMSNorm, SiLU-and-mul, rotary), for CPU float32 when they build (a
    C compiler is present) and `STOKER_DISABLE_CPU_KERNELS` is unset;
  * `torch`: the plain-torch twins in `reference.py`, for anything else.

A layer gets its set once, when the model is built (`select(device, dtype)`, called by
models/method_chooser.py for attention, norms, rotary and the gated activation), and calls it
on every forward without looking at the environment or its tensors again (DESIGN.md, seam 24).
Projections are not dispatched here: their weight method binds its kernel (layers/weight_method.py).

The module-level functions (`ops.rms_norm(x, ...)`) pick the set from their tensors on each
call: for kernel tests and tools that hold tensors, not a layer. The Triton modules import
triton at their top, so they are imported only when the triton set is first selected:
`import stoker.kernels.ops` works on a machine without triton.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from stoker.kernels import reference
from stoker.kernels.cpu import build as cpu_build
from stoker.kernels.cpu import common as cpu_common
from stoker.kernels.cpu import elementwise as cpu_elementwise
from stoker.kernels.cpu import paged_decode_attention as cpu_decode
from stoker.kernels.cpu import prefill_attention as cpu_prefill
from stoker.kernels.cpu import store_kvcache as cpu_store


@dataclass(frozen=True)
class Kernels:
    """One backend's kernels, with reference.py's signatures (see there for shapes)."""

    name: str  # "triton", "cpu" or "torch"
    store_kvcache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    @property
    def takes_device_lists(self) -> bool:
        """Prefill attention reads its offsets and lengths from device tensors (GPU kernels:
        no host-to-device copy per layer); the others loop on host lists."""
        return self.name == "triton"


TORCH = Kernels("torch", reference.store_kvcache, reference.paged_decode_attention, reference.paged_attention,
                reference.rms_norm, reference.fused_add_rms_norm, reference.silu_and_mul, reference.rotary_embedding)
CPU = Kernels("cpu", cpu_store.store_kvcache, cpu_decode.paged_decode_attention, cpu_prefill.paged_attention,
              cpu_elementwise.rms_norm, cpu_elementwise.fused_add_rms_norm, cpu_elementwise.silu_and_mul,
              cpu_elementwise.rotary_embedding)


_CPU_TWIN_PREFILL = dataclasses.replace(CPU, paged_attention=reference.paged_attention)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing driver libraries, ...)
        return False
    return True


def triton_disabled() -> bool:
    """STOKER_DISABLE_TRITON=1 forces the torch twins (read when a set is selected)."""
    return os.environ.get("STOKER_DISABLE_TRITON", "0").strip().lower() not in ("", "0", "false", "no")


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not triton_disabled() and triton_available()


@functools.cache
def _kernel(module: str) -> ModuleType:
    return importlib.import_module(f"stoker.kernels.{module}")


@functools.cache
def _triton() -> Kernels:
    decode = _kernel("paged_decode_attention").paged_decode_attention
    prefill = _kernel("paged_prefill_attention").paged_attention
    norm = _kernel("rms_norm")

    def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None,
                               k_scale=1.0, v_scale=1.0, *, logits_soft_cap=None):  # the launcher takes these by keyword
        return decode(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                      k_scale=k_scale, v_scale=v_scale, logits_soft_cap=logits_soft_cap)

    def paged_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, sliding_window=None,
                        k_scale=1.0, v_scale=1.0, *, logits_soft_cap=None):
        return prefill(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, sliding_window,
                       k_scale=k_scale, v_scale=v_scale, logits_soft_cap=logits_soft_cap)

    return Kernels("triton", _kernel("store_kvcache").store_kvcache, paged_decode_attention, paged_attention,
                   norm.rms_norm, norm.fused_add_rms_norm, _kernel("activation").silu_and_mul,
                   _kernel("rotary").rotary_embedding)


def select(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> Kernels:
    """The kernel set for layers on `device` computing in `dtype`: chosen once, at build time.
    head_dim: an attention layer's; the C prefill kernel needs a multiple of its vector width
    (elsewhere that layer's prefill takes the torch twin)."""
    if device.type == "cuda" and not triton_disabled() and triton_available():
        return _triton()
    if device.type == "cpu" and dtype == torch.float32 and cpu_build.available():
        if head_dim is not None and head_dim % cpu_prefill.vector_width():
            return _CPU_TWIN_PREFILL
        return CPU
    return TORCH


# ---------------------------------------------------------------- per-call entry points (tests, tools)
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
        return _triton().store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    kernels = CPU if cpu_store.store_supported(key, value, k_cache) else TORCH
    return kernels.store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


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
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap)
) -> torch.Tensor:  # (B, H, D)
    return _for_attention(query, k_cache).paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, k_scale, v_scale,
        **_soft_cap(logits_soft_cap))


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
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap)
) -> torch.Tensor:  # (T, H, D)
    return _for_attention(query, k_cache).paged_attention(
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, sliding_window, k_scale, v_scale,
        **_soft_cap(logits_soft_cap))


def _soft_cap(cap: float | None) -> dict[str, float]:
    """The soft cap as a keyword, only when set (a set's kernels are then called as without one)."""
    return {"logits_soft_cap": cap} if cap else {}


def _for_attention(query: torch.Tensor, k_cache: torch.Tensor) -> Kernels:
    if use_triton(query):
        return _triton()
    if not cpu_common.supports(query, k_cache):
        return TORCH
    return CPU if cpu_prefill.prefill_supported(query, k_cache) else _CPU_TWIN_PREFILL


def _for_rows(*tensors: torch.Tensor) -> Kernels:
    if use_triton(tensors[0]):
        return _triton()
    return CPU if cpu_common.supports_rows(*tensors) else TORCH


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _for_rows(x, weight).rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _for_rows(x, residual, weight).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _for_rows(x).silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, Hkv, D)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim) float32
) -> tuple[torch.Tensor, torch.Tensor]:
    return _for_rows(query, key, cos_sin_cache).rotary_embedding(positions, query, key, cos_sin_cache)
