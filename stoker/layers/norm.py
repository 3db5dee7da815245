"""RMSNorm, optionally fused with the residual add that precedes it; its kernel set is bound
once, when the model is built (kernels/ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from stoker.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.kernels: ops.Kernels = ops.TORCH  # the builder binds the device's set

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (..., hidden). With residual: returns (norm(x + residual), x + residual)."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) x (1 + w), the scaling in float32 before the cast back
    (transformers' Gemma2RMSNorm / Gemma3RMSNorm; Llama's casts first, then scales). The
    checkpoint stores the zero-centred w. A float32 model runs its kernel set's RMSNorm with the
    weight 1 + w; other dtypes compute in float32 here. Which one is decided when built (the
    builder sets the model dtype as torch's default)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()
        self.in_float32 = torch.get_default_dtype() == torch.float32

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (..., hidden). With residual: returns (norm(x + residual), x + residual)."""
        if self.in_float32:
            scale = self.weight + 1.0  # (hidden,)
            if residual is None:
                return self.kernels.rms_norm(x, scale, self.eps)
            return self.kernels.fused_add_rms_norm(x, residual, scale, self.eps)
        if residual is not None:
            x = residual = x + residual
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
