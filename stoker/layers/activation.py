"""Gated activations. The MLP computes gate and up in one GEMM; this splits and combines."""

from __future__ import annotations

import torch
from torch import nn

from stoker.kernels import ops

_SUPPORTED = ("silu", "swish")


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2 * d) -> (T, d)
        return ops.silu_and_mul(x)


def get_gated_activation(hidden_act: str) -> nn.Module:
    if hidden_act not in _SUPPORTED:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(_SUPPORTED)}")
    return SiluAndMul()
