"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's shape with NoPE layers, attention without any
positional rotation on the layers `no_rope_layers` marks 0 (1: rotary as usual; SmolLM3-3B
leaves every fourth layer unrotated). Without the list in config.json, transformers' default
applies: a NoPE layer every `no_rope_layer_interval` (4) layers, the last of each group.
A sliding window applies to a layer only with `use_sliding_window` and `layer_types` marking
it "sliding_attention" (SmolLM3-3B uses neither).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.models.llama import LlamaAttention, LlamaForCausalLM


def no_rope_layers(cfg: dict[str, Any]) -> list[int]:
    """Per layer: 1 rotates q and k, 0 does not (transformers' SmolLM3Config default when absent)."""
    n = cfg["num_hidden_layers"]
    layers = cfg.get("no_rope_layers")
    if layers is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        layers = [int((i + 1) % interval != 0) for i in range(n)]
    if len(layers) != n:
        raise ValueError(f"no_rope_layers lists {len(layers)} layers, but num_hidden_layers is {n}")
    return [int(x) for x in layers]


class NoRotary(nn.Module):
    """A NoPE layer's stand-in for rotary: q and k unchanged."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class SmolLM3Attention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, *args: Any) -> None:
        super().__init__(cfg, layer_idx, *args)
        self.use_rope = bool(no_rope_layers(cfg)[layer_idx])
        if not self.use_rope:
            self.rotary = NoRotary()  # type: ignore[assignment]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_cls = SmolLM3Attention

    @classmethod
    def sliding_window(cls, cfg: dict[str, Any], layer_idx: int) -> int | None:
        if not cfg.get("use_sliding_window"):
            return None
        return super().sliding_window(cfg, layer_idx)
