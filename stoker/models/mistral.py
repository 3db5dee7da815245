"""Mistral (`MistralForCausalLM`): Llama's shape with an optional sliding window on every layer.

Mistral 7B v0.1 sets `sliding_window: 4096`; v0.2 and later set it to null (full attention).
"""

from __future__ import annotations

from typing import Any

from stoker.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def qkv_bias(cls, cfg: dict[str, Any]) -> bool:
        return False

    @classmethod
    def sliding_window(cls, cfg: dict[str, Any], layer_idx: int) -> int | None:
        if cfg.get("layer_types"):
            return super().sliding_window(cfg, layer_idx)
        return cfg.get("sliding_window")
