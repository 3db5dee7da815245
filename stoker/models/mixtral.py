"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a sparse feed-forward block on
every layer: `num_local_experts` experts of `intermediate_size`, the top `num_experts_per_tok`
of a softmax router, their weights always renormalised to sum to one.

Checkpoint names: model.layers.{i}.block_sparse_moe.gate (the router) and
block_sparse_moe.experts.{e}.{w1,w2,w3} (w1 gate, w3 up, w2 down).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.models.llama import LlamaDecoderLayer
from stoker.models.mistral import MistralForCausalLM
from stoker.models.moe_block import SparseMoeBlock, num_experts_of


class MixtralDecoderLayer(LlamaDecoderLayer):
    """The feed-forward block under the checkpoint's name for it, `block_sparse_moe`."""

    def __init__(self, self_attn: nn.Module, cfg: dict[str, Any], tp: TensorParallelGroup,
                 mlp: nn.Module | None = None) -> None:
        super().__init__(self_attn, cfg, tp, mlp)
        self.block_sparse_moe = self._modules.pop("mlp")

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(hidden)


class MixtralForCausalLM(MistralForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
    expert_params = {"w1": "w1", "w2": "w2", "w3": "w3"}

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return SparseMoeBlock(cfg, tp, num_experts=num_experts_of(cfg), intermediate_size=cfg["intermediate_size"],
                              renormalize=True)
