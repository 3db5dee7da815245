"""Qwen3 (`Qwen3ForCausalLM`): Llama's shape plus an RMSNorm over each head of q and k
(before rotary), `attention_bias` on q/k/v/o, an explicit `head_dim`, optional sliding window."""

from __future__ import annotations

from typing import Any

import torch

from stoker.layers.norm import RMSNorm
from stoker.models.llama import LlamaAttention, LlamaForCausalLM
from stoker.models.qwen2 import qwen_sliding_window


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # (T, H, D), normalised over D


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    @classmethod
    def sliding_window(cls, cfg: dict[str, Any], layer_idx: int) -> int | None:
        return qwen_sliding_window(cfg, layer_idx)
