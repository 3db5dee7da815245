"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama's shape with biases on q, k and v (never on o),
and sliding-window attention on layers >= `max_window_layers` when `use_sliding_window`."""

from __future__ import annotations

from typing import Any

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.models.llama import LlamaForCausalLM


def qwen_sliding_window(cfg: dict[str, Any], layer_idx: int) -> int | None:
    """As transformers' Qwen2/Qwen3 configs derive `layer_types` when a config omits them."""
    layer_types = cfg.get("layer_types")
    if layer_types:
        return cfg.get("sliding_window") if layer_types[layer_idx] == "sliding_attention" else None
    if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
        return None
    return cfg["sliding_window"] if layer_idx >= cfg.get("max_window_layers", 28) else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def qkv_bias(cls, cfg: dict[str, Any]) -> bool:
        return True

    @classmethod
    def sliding_window(cls, cfg: dict[str, Any], layer_idx: int) -> int | None:
        return qwen_sliding_window(cfg, layer_idx)

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        # Qwen2's o_proj has no bias whatever `attention_bias` says (the config has no such field).
        super().__init__({**cfg, "attention_bias": False}, max_position, tp)
