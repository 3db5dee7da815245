"""Float experts on CUDA through the Triton fused-MoE kernel (kernels/fused_moe.py).

The parameters are the base method's, unchanged (w13 (E, 2I, H), w2 (E, H, I) in the model
dtype), so loading and expert parallelism are the base method's too; `apply` is one call of the
kernel: the pairs aligned per expert on the device, both GEMMs with the activation and the
routing weight fused, the top-k sum. At decode's few pairs (T <= SMALL_BATCH_TOKENS, known
from the shapes) the kernel takes its GEMV-style small-batch path instead: each program streams
rows of one pair's expert weight, no tl.dot tile of padding. No host read of the routing either
way, so the decode CUDA graphs can hold the layer (`graph_capturable`).
"""

from __future__ import annotations

import torch

from stoker.layers.moe import FusedMoE, MoEMethod

# transformers' ACT2FN names (layers/activation.py) -> the gate the kernel applies
_KERNEL_ACTIVATION = {
    "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "relu": "relu",
}


def kernel_activation(hidden_act: str) -> str:
    """The fused-MoE kernel's name for the layer's gate (every gate FusedMoE accepts has one)."""
    if hidden_act not in _KERNEL_ACTIVATION:
        raise ValueError(f"hidden_act {hidden_act!r} has no gate in the Triton fused-MoE kernel; "
                         f"supported: {', '.join(_KERNEL_ACTIVATION)}")
    return _KERNEL_ACTIVATION[hidden_act]


class TritonMoEMethod(MoEMethod):
    """Float experts (float16 / bfloat16 / float32) on CUDA, one fused-MoE kernel call per layer."""

    graph_capturable = True

    def __init__(self) -> None:
        from stoker.kernels import fused_moe

        self.kernel = fused_moe.fused_moe  # or its twin reference.fused_moe_grouped, for tests
        self.activation = "silu"

    def create_weights(self, layer: FusedMoE) -> None:
        super().create_weights(layer)
        self.activation = kernel_activation(layer.hidden_act)

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H) -> (T, H)
        return self.kernel(x, layer.w13, layer.w2, topk_weights, topk_ids, self.activation)
