"""OLMoE (`OlmoeForCausalLM`): Llama's shape with an RMSNorm over the whole q and the whole k
projection (not per head, as Qwen3 does), before rotary, and a sparse block on every layer:
softmax top-k experts, renormalised only with `norm_topk_prob` (false in OLMoE-1B-7B).

Checkpoint: self_attn.q_norm (hidden), self_attn.k_norm (num_kv_heads x head_dim),
mlp.gate, mlp.experts.{e}.{gate,up,down}_proj.

Refused when built: `clip_qkv` (a clamp of q, k and v after the norms that the shared
attention does not take yet) and tensor parallelism (the q/k norms reduce over all heads,
which a rank does not hold).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.norm import RMSNorm
from stoker.models.llama import LlamaAttention, LlamaForCausalLM
from stoker.models.moe_block import SparseMoeBlock, num_experts_of
from stoker.models.moe_loading import QWEN_EXPERT_PARAMS


class OlmoeAttention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.q_norm = RMSNorm(self.q_size, eps)
        self.k_norm = RMSNorm(self.kv_size, eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (T, H, D) -> normalised over H x D, the whole projection -> (T, H, D)
        t = q.shape[0]
        q = self.q_norm(q.reshape(t, self.q_size)).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(t, self.kv_size)).view(t, self.num_kv_heads, self.head_dim)
        return q, k


class OlmoeForCausalLM(LlamaForCausalLM):
    attention_cls = OlmoeAttention
    expert_params = QWEN_EXPERT_PARAMS

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"OLMoE with clip_qkv {cfg['clip_qkv']} is not supported yet (q, k, v clamped after the "
                             "norms); released OLMoE checkpoints set it to null")
        if tp is not None and tp.world_size > 1:
            raise ValueError("tensor parallelism (--tensor-parallel-size) is not supported for OLMoE yet: its q/k "
                             "RMSNorm spans all heads, which no rank holds")
        super().__init__(cfg, max_position, tp)

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return SparseMoeBlock(cfg, tp, num_experts=num_experts_of(cfg), intermediate_size=cfg["intermediate_size"],
                              renormalize=bool(cfg.get("norm_topk_prob", False)))
