"""Fused SiLU-and-multiply for gated MLPs (SwiGLU, Shazeer 2020).

Twin: `reference.silu_and_mul`. The gate/up GEMM writes (..., 2 * d) = [gate | up]; this reads
both halves once and writes silu(gate) * up, computed in float32 and rounded once (the twin,
in a 16-bit dtype, rounds silu(gate) before the product: within one 16-bit ulp of this).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import FLOAT_DTYPES, check, check_last_dim_contiguous, check_same_device, next_pow2

_BLOCK = 1024  # columns per program: a 2-D grid keeps wide MLPs (d = 14336) on many SMs


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (rows, 2 * d): [gate | up]
    out_ptr,  # (rows, d)
    stride_x,
    stride_o,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # (..., 2 * d) [gate | up]
    *,
    out: torch.Tensor | None = None,  # (..., d) contiguous, x's dtype; allocated if None
) -> torch.Tensor:  # (..., d)
    check(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x must be (..., 2 * d), got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} not in {FLOAT_DTYPES}")
    check_last_dim_contiguous("x", x)
    d = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    check(tuple(out.shape) == out_shape and out.dtype == x.dtype, f"out must be {out_shape} {x.dtype}")
    check(out.is_contiguous(), "out must be contiguous")
    check_same_device(x=x, out=out)
    x2 = x.reshape(-1, 2 * d)
    num_rows = x2.shape[0]
    if num_rows and d:
        block = min(_BLOCK, next_pow2(d))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
            x2, out.view(-1, d), x2.stride(0), d, d, BLOCK=block, num_warps=4
        )
    return out
