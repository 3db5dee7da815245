"""The sparse feed-forward blocks the MoE families share: a router, the experts, and an
optional shared expert with its sigmoid gate (Qwen2-MoE, `SparseMoeBlock`); DeepSeek-V3's
grouped sigmoid router with ungated shared experts (GLM-4.5, `GroupedTopKMoeBlock`).

Parameter names follow the Qwen/Mixtral checkpoints: `gate.weight` (the router),
`experts.{e}.{gate_proj|up_proj|down_proj}` or `experts.{e}.{w1|w3|w2}` (stacked into
`experts.w13` / `experts.w2` by models/moe_loading.py), `shared_expert.{gate,up,down}_proj`,
`shared_expert_gate.weight`; GLM-4.5 / DeepSeek-V3: `gate.weight`, `gate.e_score_correction_bias`,
`experts.{e}.{gate,up,down}_proj`, `shared_experts.{gate,up,down}_proj`.

Which layers are sparse is the family's `mlp_block` hook (models/llama.LlamaForCausalLM).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.expert_partition import ExpertPartition
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import WHOLE, Partition
from stoker.layers.activation import sigmoid_per_row
from stoker.layers.linear import Linear
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_router import GroupedTopKRouter, SoftmaxTopKRouter
from stoker.models.llama import LlamaMLP, split_evenly


def dense_mlp(cfg: dict[str, Any], intermediate_size: int, tp: TensorParallelGroup) -> LlamaMLP:
    """A gated MLP of `intermediate_size` columns (a MoE model's dense layers, its shared expert)."""
    return LlamaMLP({**cfg, "intermediate_size": intermediate_size, "mlp_bias": False}, tp)


def num_experts_of(cfg: dict[str, Any]) -> int:
    """The Hub's Qwen-MoE and OLMoE configs say `num_experts`, Mixtral's `num_local_experts`;
    transformers 5 writes `num_local_experts` for Qwen3-MoE too."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_sparse_layer(cfg: dict[str, Any], layer_idx: int) -> bool:
    """Qwen-MoE's rule: layers not in `mlp_only_layers`, every `decoder_sparse_step`-th one."""
    if not num_experts_of(cfg) or layer_idx in (cfg.get("mlp_only_layers") or []):
        return False
    return (layer_idx + 1) % (cfg.get("decoder_sparse_step") or 1) == 0


def moe_partitions(num_experts: int, intermediate_size: int, field: str,
                   tp: TensorParallelGroup) -> tuple[Partition, ExpertPartition | None]:
    """How a FusedMoE is cut over the group: each expert's I (tensor parallelism), or whole
    experts dealt out to the ranks (--enable-expert-parallel; I need not divide then)."""
    if tp.expert_parallel:
        return WHOLE, ExpertPartition(num_experts, tp.world_size, tp.rank)
    return split_evenly(intermediate_size, field, tp), None


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        tp: TensorParallelGroup,
        *,
        num_experts: int,
        intermediate_size: int,
        renormalize: bool,
        shared_expert_size: int = 0,
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.gate = SoftmaxTopKRouter(hidden, num_experts, cfg["num_experts_per_tok"], renormalize)
        part, experts = moe_partitions(num_experts, intermediate_size, "moe_intermediate_size", tp)
        self.experts = FusedMoE(num_experts, hidden, intermediate_size, cfg.get("hidden_act", "silu"), split=part, tp=tp,
                                experts=experts)
        self.shared_expert: LlamaMLP | None = None
        if shared_expert_size:
            self.shared_expert = dense_mlp(cfg, shared_expert_size, tp)
            self.shared_expert_gate = Linear(hidden, 1)  # replicated: one logit per token

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        topk_weights, topk_ids = self.gate.route(x)  # (T, k) float32, (T, k)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + sigmoid_per_row(self.shared_expert_gate(x)) * self.shared_expert(x)  # (T, 1) gate
        return out


class GroupedTopKMoeBlock(nn.Module):
    """DeepSeek-V3's sparse block (GLM-4.5's too): `n_routed_experts` experts of
    `moe_intermediate_size` chosen by a grouped sigmoid router (layers/moe_router.GroupedTopKRouter),
    plus `n_shared_experts` shared experts every token takes, ungated, held as one dense MLP
    `n_shared_experts` x `moe_intermediate_size` wide (the sum of their outputs is that MLP's).

    Config fields (defaults as transformers' Glm4MoeConfig): n_routed_experts,
    num_experts_per_tok, moe_intermediate_size, n_shared_experts (1), n_group (1), topk_group
    (1), norm_topk_prob (true), routed_scaling_factor (1.0).
    """

    def __init__(self, cfg: dict[str, Any], tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
        num_experts = int(cfg.get("n_routed_experts") or num_experts_of(cfg))
        self.gate = GroupedTopKRouter(
            hidden, num_experts, cfg["num_experts_per_tok"], num_groups=int(cfg.get("n_group") or 1),
            topk_groups=int(cfg.get("topk_group") or 1), renormalize=bool(cfg.get("norm_topk_prob", True)),
            scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )  # fmt: skip
        part = split_evenly(inter, "moe_intermediate_size", tp)
        self.experts = FusedMoE(num_experts, hidden, inter, cfg.get("hidden_act", "silu"), split=part, tp=tp)
        shared = int(cfg.get("n_shared_experts", 1) or 0) * inter
        self.shared_experts: LlamaMLP | None = dense_mlp(cfg, shared, tp) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        topk_weights, topk_ids = self.gate.route(x)  # (T, k) float32, (T, k)
        out = self.experts(x, topk_weights, topk_ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)
