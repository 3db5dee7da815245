"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`): Llama's shape with rotary on only the first
`partial_rotary_factor` of each head (0.5 when the config says nothing, as transformers'
default), optional per-head q/k RMSNorm (`use_qk_norm`), biases on q/k/v (`attention_bias`)
but never on o, the first `first_k_dense_replace` layers dense (`intermediate_size`) and
the rest DeepSeek-V3's sparse block (models/moe_block.GroupedTopKMoeBlock: grouped sigmoid
router with a correction bias, routed scaling, ungated shared experts).

Checkpoint: self_attn.{q,k,v}_proj (+ bias), self_attn.o_proj, self_attn.{q,k}_norm,
mlp.{gate,up,down}_proj (dense layers), mlp.gate.weight, mlp.gate.e_score_correction_bias,
mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj. The Hub's
checkpoints also hold the multi-token-prediction layer(s) as model.layers.{num_hidden_layers + i}
(`num_nextn_predict_layers`); they are skipped, as transformers skips them (speculative
decoding with them is not implemented).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.norm import RMSNorm
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.llama import LlamaAttention, LlamaForCausalLM
from stoker.models.moe_block import GroupedTopKMoeBlock, dense_mlp
from stoker.models.moe_loading import QWEN_EXPERT_PARAMS


def with_glm_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' Glm4MoeConfig rotates half of each head when no config field says
    otherwise; make that explicit so the rotary embedding reads it."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if cfg.get("partial_rotary_factor") is None and "partial_rotary_factor" not in rope:
        return {**cfg, "partial_rotary_factor": 0.5}
    return cfg


class Glm4MoeAttention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None, tp: TensorParallelGroup) -> None:
        # attention_bias puts biases on q, k and v (qkv_bias) but not on o_proj
        super().__init__({**cfg, "attention_bias": False}, layer_idx, rotary, qkv_bias, sliding_window, tp)
        self.use_qk_norm = bool(cfg.get("use_qk_norm", False))
        if self.use_qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-5)
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)  # (T, H, D), normalised over D, before rotary


class Glm4MoeForCausalLM(LlamaForCausalLM):
    attention_cls = Glm4MoeAttention
    expert_params = QWEN_EXPERT_PARAMS

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(with_glm_defaults(cfg), max_position, tp)

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        if layer_idx < int(cfg.get("first_k_dense_replace", 1)):
            return dense_mlp(cfg, cfg["intermediate_size"], tp)
        return GroupedTopKMoeBlock(cfg, tp)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The multi-token-prediction layers, numbered after the decoder's last."""
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 3 or not parts[2].isdigit():
            return False
        return int(parts[2]) >= self.config["num_hidden_layers"]
