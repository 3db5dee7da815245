"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k RMSNorm) with a sparse
feed-forward block on every `decoder_sparse_step`-th layer not in `mlp_only_layers`
(the others dense, `intermediate_size` wide).

Config fields beyond Qwen3's: num_experts, num_experts_per_tok, moe_intermediate_size,
norm_topk_prob (renormalise the top-k weights), decoder_sparse_step, mlp_only_layers.
Checkpoint experts: mlp.experts.{e}.{gate_proj,up_proj,down_proj}; router mlp.gate.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.models.moe_block import SparseMoeBlock, dense_mlp, is_sparse_layer, num_experts_of
from stoker.models.moe_loading import QWEN_EXPERT_PARAMS
from stoker.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_params = QWEN_EXPERT_PARAMS

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        if not is_sparse_layer(cfg, layer_idx):
            return dense_mlp(cfg, cfg["intermediate_size"], tp)
        return SparseMoeBlock(cfg, tp, num_experts=num_experts_of(cfg), intermediate_size=cfg["moe_intermediate_size"],
                              renormalize=bool(cfg.get("norm_topk_prob", False)))
