"""OLMoE (`OlmoeForCausalLM`): Llama's shape with an RMSNorm over the whole q and the whole k
projection (not per head, as Qwen3 does), before rotary, and a sparse block on every layer:
softmax top-k experts, renormalised only with `norm_topk_prob` (false in OLMoE-1B-7B).

Checkpoint: self_attn.q_norm (hidden), self_attn.k_norm (num_kv_heads x head_dim),
mlp.gate, mlp.experts.{e}.{gate,up,down}_proj.

Refused when built: `clip_qkv` (a clamp of q, k and v after the norms that the shared
attention does not take yet). Under tensor parallelism the q/k norms add every rank's sums of
squares (OLMo 2's attention, layers/projection_norm.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.models.llama import LlamaForCausalLM
from stoker.models.moe_block import SparseMoeBlock, num_experts_of
from stoker.models.moe_loading import QWEN_EXPERT_PARAMS
from stoker.models.olmo2 import Olmo2Attention


class OlmoeForCausalLM(LlamaForCausalLM):
    # OLMo 2's attention: the q/k RMSNorm over the whole projection, one all-reduce of the sums of
    # squares per projection under tensor parallelism (layers/projection_norm.py)
    attention_cls = Olmo2Attention
    expert_params = QWEN_EXPERT_PARAMS

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"OLMoE with clip_qkv {cfg['clip_qkv']} is not supported yet (q, k, v clamped after the "
                             "norms); released OLMoE checkpoints set it to null")
        super().__init__(cfg, max_position, tp)

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return SparseMoeBlock(cfg, tp, num_experts=num_experts_of(cfg), intermediate_size=cfg["intermediate_size"],
                              renormalize=bool(cfg.get("norm_topk_prob", False)))
