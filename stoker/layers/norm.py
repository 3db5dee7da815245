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
