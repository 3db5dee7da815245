"""Mixture-of-Experts routers: hidden states -> each token's top-k experts and their weights.

A router is its own module so that the experts (layers/moe.FusedMoE) take the choices
whatever made them. Routing runs in float32 whatever the model dtype: a bf16 logit can tie
or swap two experts that float32 keeps apart, and the choice is discrete (vLLM and
transformers also take the softmax in float32). The weight is stored in float32 too (it is
E x H, small beside the experts).

Here: softmax over all experts, then top-k (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), with the
k weights renormalised to sum to one or not (`norm_topk_prob`). Later routers (gpt-oss's
biased logits, DeepSeek's grouped sigmoid with a correction bias) are further classes here
with the same `forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SoftmaxTopKRouter(nn.Module):
    """Checkpoint tensor `gate.weight` (E, H), a linear layer without bias."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> topk_weights (T, k) float32, topk_ids (T, k) int64."""
        logits = F.linear(x.float(), self.weight)  # (T, E)
        return softmax_topk(logits, self.top_k, self.renormalize)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}"


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) float32 logits -> the k largest softmax probabilities (T, k) and their experts."""
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
