"""Small helpers shared by the Triton launchers (no triton import here, so ops.py can use it)."""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check(cond: bool, msg: str) -> None:
    """Launcher argument checks; a ValueError (not `assert`) so `python -O` keeps them."""
    if not cond:
        raise ValueError(msg)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.stride(-1) == 1, f"{name}: last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")


def dot_args(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_FP32, PRECISION) constexprs for kernels that call tl.dot on `dtype` operands.

    DOT_FP32: the interpreter (triton 3.9) multiplies bfloat16 operands as their raw uint16
    bits, so under it we upcast the operands to float32 first; on a GPU the operands stay in
    the model dtype and hit the tensor cores. PRECISION: float32 inputs use exact "ieee"
    products (the default "tf32" would keep ~10 mantissa bits); ignored for 16-bit inputs.
    """
    return interpreting() and dtype == torch.bfloat16, "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of the CUDA device; 132 (H100/H200) for the interpreter, so that
    the split heuristics behave in tests as they would on the GPU we target."""
    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def kv_inverse_scales(k_scale: float, v_scale: float) -> tuple[float, float]:
    """1 / scale rounded to float32 once: every FP8 KV store (C, Triton, twin) stores
    e4m3(clamp(x * inverse, -448, 448)) with these, so all three write the same bits."""
    return float(torch.tensor(1.0 / k_scale, dtype=torch.float32)), float(torch.tensor(1.0 / v_scale, dtype=torch.float32))
