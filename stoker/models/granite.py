"""Granite 3 (`GraniteForCausalLM`, IBM Granite 3.0 to 3.3): Llama's shape with four scalars.

    embeddings x embedding_multiplier                       (the residual stream's start)
    softmax scale = attention_multiplier                    (not head_dim^-0.5)
    x' = x + residual_multiplier x branch                   (after attention and after the MLP)
    logits = lm_head(h) / logits_scaling

The residual multiplier scales each branch before the add that the next norm fuses, so the
fused add + RMSNorm kernels stay as they are. Granite 3 ties the LM head to the embedding
(tie_word_embeddings), so the embedding multiplier is applied to the looked-up rows, never
folded into the shared weight. A multiplier config.json leaves out is 1.0, as in transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.attention import Attention
from stoker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


# transformers' GraniteConfig defaults, for a config.json that leaves a multiplier out
DEFAULT_MULTIPLIERS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                       "logits_scaling": 1.0}


def granite_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with the four multipliers filled in as transformers would (1.0 when absent)."""
    return {**cfg, **{k: v for k, v in DEFAULT_MULTIPLIERS.items() if cfg.get(k) is None}}


class GraniteAttention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        a = self.attn
        self.attn = Attention(a.num_heads, a.num_kv_heads, a.head_dim, float(cfg["attention_multiplier"]), a.sliding_window)


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, self_attn: torch.nn.Module, cfg: dict[str, Any], tp: TensorParallelGroup,
                 mlp: torch.nn.Module | None = None) -> None:
        super().__init__(self_attn, cfg, tp, mlp)
        self.residual_multiplier = float(cfg["residual_multiplier"])

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.norm_input(hidden, residual)
        hidden = self.self_attn(positions, hidden) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    def __init__(self, cfg: dict[str, Any], *args: Any) -> None:
        super().__init__(cfg, *args)
        self.embedding_multiplier = float(cfg["embedding_multiplier"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embedding_multiplier  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GraniteForCausalLM(LlamaForCausalLM):
    attention_cls = GraniteAttention
    decoder_layer_cls = GraniteDecoderLayer
    model_cls = GraniteModel

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(granite_config(cfg), max_position, tp)
        self.logits_scaling = float(self.config["logits_scaling"])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.logits_scaling
