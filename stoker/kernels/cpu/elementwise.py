"""Python entry points of elementwise.c, the row-wise kernels (float32): rms_norm,
fused_add_rms_norm, silu_and_mul, rotary_embedding; argument checks, then one ctypes call.

Each function has reference.py's signature and semantics (its twin); `kernels/ops.py` calls
them for CPU float32 tensors when `common.supports_rows()`. The C code trusts its indices, so
everything that could make it read or write outside a tensor is checked here first.
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu.build import library
from stoker.kernels.cpu.common import _as_rows, _head_rows, _threads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, stride = _as_rows(x)
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    library().stoker_rms_norm_f32(
        rows.data_ptr(), stride, None, 0, weight.data_ptr(), out.data_ptr(), None, rows.shape[0], rows.shape[1], eps,
        _threads(rows.numel()),
    )
    return out if rows is x else out.view(x.shape)  # a view is a new tensor object: ~2-4 us


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    rows, stride = _as_rows(x)
    res_rows, res_stride = _as_rows(residual)
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    new_residual = torch.empty(rows.shape, dtype=x.dtype)
    library().stoker_rms_norm_f32(
        rows.data_ptr(), stride, res_rows.data_ptr(), res_stride, weight.data_ptr(), out.data_ptr(),
        new_residual.data_ptr(), rows.shape[0], rows.shape[1], eps, _threads(rows.numel()),
    )
    if rows is x:  # (T, hidden): already x's shape (a view is a new tensor object: ~2-4 us)
        return out, new_residual
    return out.view(x.shape), new_residual.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) [gate | up] -> (..., d) silu(gate) * up."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    rows, stride = _as_rows(x)
    d = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], d), dtype=x.dtype)
    library().stoker_silu_and_mul_f32(rows.data_ptr(), stride, out.data_ptr(), rows.shape[0], d, _threads(rows.numel()))
    return out.view(*x.shape[:-1], d)


def rotary_embedding(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, Hkv, D)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim) float32: [cos | sin]
) -> tuple[torch.Tensor, torch.Tensor]:
    q, q_stride = _head_rows(query, "query")
    k, k_stride = _head_rows(key, "key")
    num_tokens, head_dim = q.shape[0], q.shape[2]
    rot_dim = cos_sin_cache.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)}, query {tuple(q.shape)}, key {tuple(k.shape)} disagree")
    if rot_dim % 2 or rot_dim > head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype} does not fit head_dim {head_dim}")
    positions = positions.to(torch.int64).contiguous()
    cos_sin = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    # The C code indexes the table with the positions; it checks them all before any read.
    bad = library().stoker_rotary_f32(
        positions.data_ptr(), q.data_ptr(), q_stride, k.data_ptr(), k_stride, cos_sin.data_ptr(), cos_sin.shape[0],
        q_out.data_ptr(), k_out.data_ptr(), num_tokens, q.shape[1], k.shape[1], head_dim, rot_dim, _threads(q.numel()),
    )  # fmt: skip
    if bad:
        raise ValueError(f"positions must be in [0, {cos_sin_cache.shape[0]})")
    return q_out, k_out
