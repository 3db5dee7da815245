"""RMSNorm and fused residual-add + RMSNorm (Zhang & Sennrich 2019), one row per program.

Twins: `reference.rms_norm`, `reference.fused_add_rms_norm`. Rounding follows HF Llama, which
the twins copy: the sum x + residual is rounded to the model dtype (that rounded value is the
new residual and what gets normalised), normalisation runs in float32, the normalised value is
rounded to the input dtype and only then multiplied by the weight. Fusing the add means the
hidden state is read once and written twice (residual, normed) instead of three round trips.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import FLOAT_DTYPES, check, check_last_dim_contiguous, check_same_device, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (rows, hidden)
    residual_ptr,  # (rows, hidden), read when HAS_RESIDUAL
    weight_ptr,  # (hidden,)
    out_ptr,  # (rows, hidden)
    residual_out_ptr,  # (rows, hidden): x + residual, written when HAS_RESIDUAL
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden padded to a power of two: the whole row in registers
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)  # scalar: 1 / RMS(x)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor, hidden: int) -> torch.Tensor:
    """(..., hidden) -> (rows, hidden) view (copies only if the leading dims do not flatten)."""
    check_last_dim_contiguous(name, t)
    return t.reshape(-1, hidden)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None, residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check(x.dim() >= 1, "x must have a hidden dim")
    hidden = x.shape[-1]
    check(weight.shape == (hidden,), f"weight must be ({hidden},), got {tuple(weight.shape)}")
    check(x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES, f"dtypes x {x.dtype}, weight {weight.dtype}")
    check(weight.is_contiguous(), "weight must be contiguous")
    check_same_device(x=x, weight=weight)
    # As in the twin, the product weight * normed takes torch's promoted dtype.
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    check(out.shape == x.shape and out.dtype == out_dtype, f"out must be {tuple(x.shape)} {out_dtype}")
    check(out.is_contiguous(), "out must be contiguous")
    x2 = _rows("x", x, hidden)
    r2 = ro2 = x2
    if residual is not None:
        check(residual.shape == x.shape, f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        check(residual.dtype == x.dtype, f"residual dtype {residual.dtype} != x dtype {x.dtype}")
        check_same_device(x=x, residual=residual)
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        check(residual_out.shape == x.shape and residual_out.dtype == x.dtype, "residual_out must match x")
        check(residual_out.is_contiguous(), "residual_out must be contiguous")
        r2, ro2 = _rows("residual", residual, hidden), residual_out.view(-1, hidden)
    num_rows = x2.shape[0]
    if num_rows:
        block = next_pow2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x2, r2, weight, out.view(-1, hidden), ro2,
            x2.stride(0), r2.stride(0), hidden, ro2.stride(0),  # out is contiguous: row stride = hidden
            hidden, eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=max(1, min(16, block // 512)),
        )
    return out, residual_out


def rms_norm(
    x: torch.Tensor,  # (..., hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    *,
    out: torch.Tensor | None = None,  # (..., hidden), contiguous; allocated if None
) -> torch.Tensor:
    return _launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # (..., hidden)
    residual: torch.Tensor,  # (..., hidden), same dtype as x; not modified (unless passed as residual_out)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,  # may be `residual` itself: each row is read before written
) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(x + residual), x + residual)
    normed, new_residual = _launch(x, residual, weight, eps, out, residual_out)
    assert new_residual is not None
    return normed, new_residual
