"""Gated activations. The MLP computes gate and up in one GEMM; this splits and combines.

`hidden_act` names follow transformers' ACT2FN. The families here ship "silu"; the others
are accepted because their configs allow them (and a config edited to use one still loads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stoker.kernels import ops

# ACT2FN name -> the function applied to the gate (silu has its own fused op).
_GATE_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # same formula as HF's NewGELU
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
_SUPPORTED = ("silu", "swish", *_GATE_FNS)


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernels: ops.Kernels = ops.TORCH  # the builder binds the device's set (kernels/ops.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2 * d) -> (T, d)
        return self.kernels.silu_and_mul(x)


class GateAndMul(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2 * d) [gate | up] -> (T, d)
        d = x.shape[-1] // 2
        return self.fn(x[..., :d]) * x[..., d:]


def get_gated_activation(hidden_act: str) -> nn.Module:
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in _GATE_FNS:
        return GateAndMul(_GATE_FNS[hidden_act])
    raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(_SUPPORTED)}")


# Lanes of the widest vector loop torch's CPU elementwise kernels run (2 x 16 floats with AVX-512).
_VECTOR_LANES = 64


def sigmoid_per_row(x: torch.Tensor) -> torch.Tensor:  # (T, 1) -> (T, 1)
    """sigmoid of one value per row, the same bits whatever T: torch's CPU kernel runs the
    elements of a (T, 1) tensor that fill whole vectors through its vector exp and the tail
    through the scalar one, which may differ in the last bit, so a token's gate would depend on
    how many rows precede it. Each value is widened to a row of whole vectors instead."""
    if x.device.type != "cpu":
        return torch.sigmoid(x)
    return torch.sigmoid(x.expand(-1, _VECTOR_LANES).contiguous())[:, :1]


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:  # (T, E) -> (T, E)
    """sigmoid with the same bits for a row whatever T (`sigmoid_per_row`'s reason): on CPU
    each row is padded to whole vectors, so no element of it runs through the scalar tail."""
    pad = -x.shape[-1] % _VECTOR_LANES
    if x.device.type != "cpu" or not pad:
        return torch.sigmoid(x)
    return torch.sigmoid(F.pad(x, (0, pad)))[..., : x.shape[-1]]


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation (vLLM's "swigluoai"), (n, 2I) [gate | up] -> (n, I):
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).
    Its checkpoints interleave gate and up column by column; the loader de-interleaves them
    (models/gpt_oss_loading.py), so the halves here are contiguous like every gated layer's."""
    d = gate_up.shape[-1] // 2
    gate = gate_up[..., :d].clamp(max=limit)
    up = gate_up[..., d:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLU(nn.Module):
    """`clamped_swiglu` as a gated-activation layer (gpt-oss: `swiglu_alpha` 1.702, `swiglu_limit` 7.0)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2 * d) [gate | up] -> (T, d)
        return clamped_swiglu(x, self.alpha, self.limit)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"
