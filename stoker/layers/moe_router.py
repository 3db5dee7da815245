"""Mixture-of-Experts routers: hidden states -> each token's top-k experts and their weights.

A router is its own module so that the experts (layers/moe.FusedMoE) take the choices
whatever made them. Routing runs in float32 whatever the model dtype: a bf16 logit can tie
or swap two experts that float32 keeps apart, and the choice is discrete (vLLM and
transformers also take the softmax in float32). The weight is stored in float32 too (it is
E x H, small beside the experts).

Here:
* `SoftmaxTopKRouter`: softmax over all experts, then top-k (Mixtral, Qwen2-MoE, Qwen3-MoE,
  OLMoE), the k weights renormalised to sum to one or not (`norm_topk_prob`);
* `GroupedTopKRouter`: DeepSeek-V3's (and GLM-4.5's) sigmoid scores with a correction bias
  that only steers the choice, experts picked within the best `topk_group` of `n_group` groups,
  weights renormalised and scaled by `routed_scaling_factor`;
* `BiasedTopKRouter`: gpt-oss's: top-k of the logits (the projection has a bias), then a
  softmax over those k only.

The router's logits are a projection like any other (a `Linear`, its weight method chosen at
build: the C kernel's panels on CPU float32, which keep a token's logits independent of its
batch as the dense path's are), only always float32: `attach` creates the parameters in
float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.layers.activation import sigmoid_rows
from stoker.layers.linear import Linear
from stoker.layers.weight_method import LinearMethod


class RouterLinear(Linear):
    """A router's (E, H) projection, replicated, its parameters (and bias, gpt-oss's) float32."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__(hidden_size, num_experts, bias)

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


class BiasedTopKRouter(RouterLinear):
    """gpt-oss's router. Checkpoint tensors `router.weight` (E, H) and `router.bias` (E,)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden_size, num_experts, bias=True)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.num_experts, self.top_k = num_experts, top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> topk_weights (T, k) float32 summing to one, topk_ids (T, k) int64."""
        logits = self(x)  # (T, E), bias included
        ids = _top(logits, self.top_k)
        return torch.softmax(logits.gather(1, ids), dim=-1), ids

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}"


class GroupedTopKRouter(RouterLinear):
    """DeepSeek-V3's router, GLM-4.5's too. Checkpoint tensors `gate.weight` (E, H) and
    `gate.e_score_correction_bias` (E,), both float32.

    `e_score_correction_bias` is a plain parameter beside the method's weight: the loader
    reads it verbatim (`extra_params`), never through a weight method.
    """

    extra_params = ("e_score_correction_bias",)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, num_groups: int, topk_groups: int,
                 renormalize: bool, scaling_factor: float) -> None:
        super().__init__(hidden_size, num_experts)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        if num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"n_group {num_groups} must divide the {num_experts} routed experts")
        if not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_group {topk_groups} must be between 1 and n_group {num_groups}")
        per_group = num_experts // num_groups
        if num_groups > 1 and per_group < 2:
            raise ValueError(f"n_group {num_groups} leaves {per_group} expert per group; a group's score is the sum "
                             "of its two best experts")
        if top_k > topk_groups * per_group:
            raise ValueError(f"num_experts_per_tok {top_k} exceeds the {topk_groups * per_group} experts of the "
                             f"topk_group {topk_groups} groups chosen")
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.renormalize, self.scaling_factor = renormalize, scaling_factor
        # float32 whatever the model's dtype, as the weight (HF keeps it in float32 too)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> topk_weights (T, k) float32, topk_ids (T, k) int64."""
        return grouped_topk(self(x), self.e_score_correction_bias, self.top_k, self.num_groups, self.topk_groups,
                            self.renormalize, self.scaling_factor)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, top_k={self.top_k}, groups={self.topk_groups}/{self.num_groups}, "
                f"renormalize={self.renormalize}, scaling={self.scaling_factor}")


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lower index. torch.topk's
    choice among equal values is unspecified and differs between devices; a stable descending
    sort makes the routing the same everywhere (and matches torch.topk wherever no ties)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True)[1][..., :k]


def grouped_topk(
    logits: torch.Tensor,  # (T, E) float32
    correction_bias: torch.Tensor,  # (E,) float32
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's grouped top-k: sigmoid scores; the bias is added for choosing only; each
    group scored by the sum of its two best biased scores, the best `topk_groups` groups kept,
    then the top-k biased experts inside them. Weights are the unbiased sigmoid scores of
    those experts, renormalised (plus 1e-20, as the reference) when asked, times `scaling_factor`."""
    t, e = logits.shape
    scores = sigmoid_rows(logits)  # (T, E); a token's scores the same bits whatever its batch
    choice = scores + correction_bias  # (T, E): only steers the choice
    if topk_groups < num_groups:  # otherwise every group is kept: nothing to mask
        grouped = choice.view(t, num_groups, e // num_groups)  # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, G): the two best values (ties do not change a sum)
        keep = torch.zeros(t, num_groups, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, _top(group_scores, topk_groups), True)  # (T, G)
        choice = choice.masked_fill(~keep.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    ids = _top(choice, top_k)  # (T, k)
    weights = scores.gather(1, ids)  # (T, k) unbiased
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids
