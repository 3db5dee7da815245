"""Qwen1.5-MoE / Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases, none
on o) with a sparse block on every `decoder_sparse_step`-th layer not in `mlp_only_layers`:
softmax top-k experts (renormalised only with `norm_topk_prob`, false by default) plus a
shared expert every token takes, scaled by sigmoid(shared_expert_gate(x)).

Config fields beyond Qwen2's: num_experts, num_experts_per_tok, moe_intermediate_size,
shared_expert_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers,
qkv_bias (transformers 5; true when absent, as every released checkpoint has them).
Checkpoint: mlp.gate, mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_expert.{gate,up,down}_proj,
mlp.shared_expert_gate.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.models.moe_block import SparseMoeBlock, dense_mlp, is_sparse_layer, num_experts_of
from stoker.models.moe_loading import QWEN_EXPERT_PARAMS
from stoker.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    expert_params = QWEN_EXPERT_PARAMS

    @classmethod
    def qkv_bias(cls, cfg: dict[str, Any]) -> bool:
        return bool(cfg.get("qkv_bias", True))

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        if not is_sparse_layer(cfg, layer_idx):
            return dense_mlp(cfg, cfg["intermediate_size"], tp)
        return SparseMoeBlock(cfg, tp, num_experts=num_experts_of(cfg), intermediate_size=cfg["moe_intermediate_size"],
                              renormalize=bool(cfg.get("norm_topk_prob", False)),
                              shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0))

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """With `shared_expert_intermediate_size` 0, transformers still writes an empty shared
        expert (gate/up (0, H), down (H, 0)) and its gate (1, H); the expert's output is an empty
        sum, 0, whatever the gate says, so the block is built without them and they are not read."""
        return not self.config.get("shared_expert_intermediate_size") and ".mlp.shared_expert" in name
