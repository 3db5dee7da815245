"""The expert-parallel forward of a FusedMoE: this rank's experts over every token.

Attention's output is replicated across the tensor-parallel group, so every rank already
holds every token: no dispatch is needed. Each rank computes the contributions of the
(token, choice) pairs routed to the experts it holds, places them at their choice's slot,
and the layer's one all-reduce (the one tensor parallelism's MoE already does) sums the
ranks' partial outputs. A rank that no token chose still returns zeros and joins the
all-reduce, so no rank waits on another.

Exactness: each pair's contribution is what the whole-E method computes (the same expert
weights, the same rows in the same order, scaled and cast the same way), and each rank sums a
token's contributions in ascending expert order as `MoEMethod.apply` does, zeros in place of
the other ranks' experts. With k <= 2 the all-reduce then adds the same two numbers in either
order (or a number and zero), so EP=2 equals EP=1 bit for bit in the MoE layer; with k > 2
the sum is regrouped by rank (within rounding). A token's result does not depend on its batch
where the method's does not (the per-token order is fixed; the all-reduce adds elementwise).

The method is reused unchanged through its `apply` (k = 1 per pair), so any method (the C
kernels' packed one, a quantized one) runs under expert parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stoker.layers.moe import FusedMoE, MoEMethod


def apply_held_experts(
    method: MoEMethod, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:  # (T, H), (T, k) float32, (T, k) global ids -> (T, H) this rank's partial sum
    num_tokens, k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    held = layer.expert_split
    ids, perm = topk_ids.sort(dim=1)  # each token's choices in ascending expert order, as apply sums them
    weights = topk_weights.gather(1, perm)
    flat = ids.reshape(-1)
    mine = ((flat >= held.start) & (flat < held.stop)).nonzero().squeeze(1)  # (P,) flat (token, slot) pairs held here
    out_per_choice = torch.zeros(num_tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
    if mine.numel():
        # one pair per row, k = 1: the method's own grouping, GEMMs, scaling and cast
        rows = x.index_select(0, mine // k)
        local_ids = (flat.index_select(0, mine) - held.start)[:, None]
        pair_weights = weights.reshape(-1).index_select(0, mine)[:, None]
        out_per_choice[mine] = method.apply(layer, rows, pair_weights, local_ids)
    per_choice = out_per_choice.view(num_tokens, k, -1)
    out = per_choice[:, 0].clone()
    for j in range(1, k):
        out += per_choice[:, j]
    return out
