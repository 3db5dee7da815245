"""OLMo 2 (`Olmo2ForCausalLM`): Llama's projections with the norms moved after each branch and
q/k normalised over the whole projection.

    h = x + post_attention_layernorm(attn(x))          (no norm before attention or MLP)
    x' = h + post_feedforward_layernorm(mlp(h))

q_norm (num_heads x head_dim) and k_norm (num_kv_heads x head_dim) are RMSNorms over the
whole q and k projections, before rotary, as OLMoE's (models/olmoe.py) are; here they also run
under tensor parallelism (layers/projection_norm.py: one all-reduce of the sums of squares per
projection per layer). Checkpoint: self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
mlp.{gate,up,down}_proj, post_attention_layernorm, post_feedforward_layernorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import kv_head_partition
from stoker.layers.norm import RMSNorm
from stoker.layers.projection_norm import ProjectionRMSNorm
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None, tp: TensorParallelGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, qkv_bias, sliding_window, tp)
        eps = cfg.get("rms_norm_eps", 1e-6)
        total_heads = cfg["num_attention_heads"]
        total_kv = cfg.get("num_key_value_heads") or total_heads
        d = self.head_dim
        q_start = tp.rank * self.num_heads * d  # query heads split evenly, never replicated
        kv_part = kv_head_partition(total_kv, tp.world_size, tp.rank)
        kv_start, kv_stop = (i * d for i in kv_part.range(total_kv))
        self.q_norm = ProjectionRMSNorm(total_heads * d, eps, (q_start, q_start + self.q_size), tp)
        self.k_norm = ProjectionRMSNorm(total_kv * d, eps, (kv_start, kv_stop), tp, tp.world_size // kv_part.num_parts)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (T, H, D) -> normalised over the whole projection (this rank's H x D of it) -> (T, H, D)
        t = q.shape[0]
        q = self.q_norm(q.reshape(t, self.q_size)).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(t, self.kv_size)).view(t, self.num_kv_heads, self.head_dim)
        return q, k


class Olmo2DecoderLayer(nn.Module):
    """Returns (the MLP branch after its norm, the residual stream before it): the next layer
    (or the final norm) adds them, as Llama's layers hand on (branch, residual)."""

    def __init__(self, self_attn: nn.Module, cfg: dict[str, Any], tp: TensorParallelGroup,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = self_attn
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_feedforward_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else residual + hidden  # (T, hidden)
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    attention_cls = Olmo2Attention
    decoder_layer_cls = Olmo2DecoderLayer  # type: ignore[assignment]
