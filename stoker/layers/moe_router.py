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

The router's logits are a projection like any other (a `Linear`, its weight method chosen at
build: the C kernel's panels on CPU float32, which keep a token's logits independent of its
batch as the dense path's are), only always float32: `attach` creates the parameters in
float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

from stoker.layers.linear import Linear
from stoker.layers.weight_method import LinearMethod


class RouterLinear(Linear):
    """A router's (E, H) projection, replicated, without bias, its parameters float32."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__(hidden_size, num_experts)

    def attach(self, method: LinearMethod) -> None:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            super().attach(method)
        finally:
            torch.set_default_dtype(previous)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) any dtype -> (T, E) float32
        return super().forward(x.float())


class SoftmaxTopKRouter(RouterLinear):
    """Checkpoint tensor `gate.weight` (E, H)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__(hidden_size, num_experts)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> topk_weights (T, k) float32, topk_ids (T, k) int64."""
        return softmax_topk(self(x), self.top_k, self.renormalize)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}, renormalize={self.renormalize}"


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) float32 logits -> the k largest softmax probabilities (T, k) and their experts."""
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
