"""Gemma 2 (`Gemma2ForCausalLM`): Llama's shape with

* attention logit soft-capping (`attn_logit_softcapping`: every score s -> cap x tanh(s / cap)
  before the softmax, in the attention kernels) and final logit soft-capping
  (`final_logit_softcapping`, on the LM head's logits);
* norms before and after attention and before and after the MLP (input_layernorm,
  post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm), each an
  RMSNorm scaling by (1 + w) in float32 (layers/norm.GemmaRMSNorm), as is the final norm;
* a GeGLU MLP (`hidden_activation`, tanh-approximated GELU);
* the softmax scale `query_pre_attn_scalar` ** -0.5 instead of head_dim ** -0.5;
* embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype first (as
  transformers does: 55.4256 becomes 55.5 in bfloat16 for hidden 3072);
* sliding-window and full layers alternating (`layer_types`; configs written before it existed
  mean sliding on even layers, transformers' default), through the per-layer window path.

Gemma 3's text model (models/gemma3.py) is this with per-head q/k norms and two rotary bases.
Refused by name: `use_bidirectional_attention` (the encoder use of these weights).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.attention import Attention
from stoker.layers.norm import GemmaRMSNorm
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

# transformers' Gemma2Config / Gemma3TextConfig default (configuration_gemma2.py, configuration_gemma3.py)
QUERY_PRE_ATTN_SCALAR = 256


def gemma_mlp_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma names its activation `hidden_activation` (older configs also carry `hidden_act`,
    which transformers' Gemma MLP does not read)."""
    return {**cfg, "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"}


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None, tp: TensorParallelGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, qkv_bias, sliding_window, tp)
        scale = float(cfg.get("query_pre_attn_scalar") or QUERY_PRE_ATTN_SCALAR) ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, sliding_window,
                              logits_soft_cap=cfg.get("attn_logit_softcapping"))


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Four norms: residual + post_attn_norm(attn(input_norm(x))), then
    residual + post_ff_norm(mlp(pre_ff_norm(x))). The residual adds are fused into the next
    pre-norm, as in Llama's layer: (hidden, residual) in, (hidden, residual) out."""

    def __init__(self, self_attn: nn.Module, cfg: dict[str, Any], tp: TensorParallelGroup,
                 mlp: nn.Module | None = None) -> None:
        super().__init__(self_attn, cfg, tp, mlp)
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.norm_input(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.feed_forward(hidden)), residual


class GemmaModel(LlamaModel):
    def __init__(self, cfg: dict[str, Any], layers: list[nn.Module], tp: TensorParallelGroup) -> None:
        super().__init__(cfg, layers, tp)
        self.norm = GemmaRMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        # sqrt(hidden) rounded to the model dtype (torch's default while the model is built)
        self.register_buffer("embed_scale", torch.tensor(cfg["hidden_size"] ** 0.5).to(torch.get_default_dtype()),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def alternating_layer_types(cfg: dict[str, Any], period: int) -> list[str]:
    """`layer_types` when the config lists them, else every `period`-th layer full and the others
    sliding (transformers' defaults: Gemma 2 period 2, Gemma 3 `sliding_window_pattern`, 6)."""
    types = cfg.get("layer_types")
    if types:
        return list(types)
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])]


class Gemma2ForCausalLM(LlamaForCausalLM):
    attention_cls = GemmaAttention
    decoder_layer_cls = GemmaDecoderLayer
    model_cls = GemmaModel

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported: Stoker serves Gemma as a causal "
                             "language model; use a checkpoint whose config sets it false or leaves it out")
        super().__init__(cfg, max_position, tp)
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")

    @classmethod
    def sliding_period(cls, cfg: dict[str, Any]) -> int:
        """Every this many layers one is full when `layer_types` is absent (Gemma 2: every other)."""
        return 2

    @classmethod
    def sliding_window(cls, cfg: dict[str, Any], layer_idx: int) -> int | None:
        if alternating_layer_types(cfg, cls.sliding_period(cfg))[layer_idx] == "sliding_attention":
            return cfg.get("sliding_window")
        return None

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return LlamaMLP(gemma_mlp_config(cfg), tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As Llama's, then cap x tanh(logits / cap) with `final_logit_softcapping` (float32)."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
