"""DeepSeek-V3's grouped sigmoid router (GLM-4.5's too) against a direct float64 reading of
its definition: sigmoid scores, the correction bias added for choosing only, groups scored by
the sum of their two best biased scores, top-k inside the best groups, unbiased weights
renormalised and scaled. Ties go to the lower index, in groups and in experts."""

from __future__ import annotations

import pytest
import torch

from stoker.layers.moe_router import GroupedTopKRouter, grouped_topk


def reference(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, topk_groups: int, renormalize: bool,
              scale: float) -> tuple[list[set[int]], list[dict[int, float]]]:
    """Per token: the chosen experts and their weights, in float64, one token at a time."""
    chosen, weights = [], []
    for row in logits.double():
        scores = torch.sigmoid(row)
        biased = scores + bias.double()
        per = len(row) // groups
        group_score = [sorted(biased[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(groups)]
        ranked_groups = sorted(range(groups), key=lambda g: (-sum(group_score[g]), g))[:topk_groups]
        candidates = [e for g in sorted(ranked_groups) for e in range(g * per, (g + 1) * per)]
        top = sorted(candidates, key=lambda e: (-biased[e].item(), e))[:k]
        w = {e: scores[e].item() for e in top}
        total = sum(w.values())
        chosen.append(set(top))
        weights.append({e: (v / (total + 1e-20) if renormalize else v) * scale for e, v in w.items()})
    return chosen, weights


def check(logits, bias, k, groups, topk_groups, renormalize=True, scale=1.0) -> None:
    w, ids = grouped_topk(logits, bias, k, groups, topk_groups, renormalize, scale)
    assert w.dtype == torch.float32 and ids.shape == (logits.shape[0], k)
    ref_ids, ref_w = reference(logits, bias, k, groups, topk_groups, renormalize, scale)
    for t in range(logits.shape[0]):
        assert set(ids[t].tolist()) == ref_ids[t], f"token {t}"
        for e, v in zip(ids[t].tolist(), w[t].tolist()):
            assert v == pytest.approx(ref_w[t][e], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("groups, topk_groups, k", [(1, 1, 2), (4, 2, 3), (8, 4, 8), (8, 1, 2), (4, 4, 5)])
@pytest.mark.parametrize("renormalize, scale", [(True, 2.5), (False, 1.0)])
def test_random_logits_match_float64(groups, topk_groups, k, renormalize, scale) -> None:
    g = torch.Generator().manual_seed(groups * 10 + k)
    logits = torch.randn(64, 32, generator=g) * 2
    bias = torch.randn(32, generator=g) * 0.3
    check(logits, bias, k, groups, topk_groups, renormalize, scale)


def test_the_bias_steers_the_choice_not_the_weights() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 chosen for its bias, weighted by its own score
    w, ids = grouped_topk(logits, bias, 2, 1, 1, False, 1.0)
    assert ids[0].tolist() == [3, 0]
    assert w[0].tolist() == pytest.approx([torch.sigmoid(torch.tensor(-1.0)).item(), torch.sigmoid(torch.tensor(2.0)).item()])


def test_ties_in_group_scores_go_to_the_lower_group() -> None:
    # 4 groups of 4 with the same scores, shuffled within each group: every group scores the
    # same; two of them are kept, the lowest-numbered ones.
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, generator=g)
    logits = torch.stack([torch.cat([base[torch.randperm(4, generator=g)] for _ in range(4)]) for _ in range(16)])
    bias = torch.zeros(16)
    check(logits, bias, 3, 4, 2)
    _, ids = grouped_topk(logits, bias, 3, 4, 2, True, 1.0)
    assert (ids < 8).all()


def test_groups_tie_on_their_two_best_whatever_the_rest() -> None:
    # Three groups with the same two best scores (in another order) and different others: the
    # sum of the two best ties, so the two lowest-numbered groups are kept; inside them the
    # equal experts go by index too.
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0, 1.0, 2.0, -3.0, -3.0, 2.0, 1.0, -3.0, -3.0]])
    check(logits, torch.zeros(12), 3, 3, 2)
    _, ids = grouped_topk(logits, torch.zeros(12), 3, 3, 2, True, 1.0)
    assert sorted(ids[0].tolist()) == [0, 1, 5]


def test_all_equal_scores_pick_the_lowest_experts() -> None:
    w, ids = grouped_topk(torch.zeros(3, 16), torch.zeros(16), 4, 4, 2, True, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    assert w.tolist() == [[0.25] * 4] * 3


def test_the_router_checks_its_shape() -> None:
    make = lambda **kw: GroupedTopKRouter(16, **{**dict(num_experts=8, top_k=2, num_groups=4, topk_groups=2,
                                                        renormalize=True, scaling_factor=1.0), **kw})
    make()
    with pytest.raises(ValueError, match="n_group 3 must divide"):
        make(num_groups=3)
    with pytest.raises(ValueError, match="topk_group 5"):
        make(topk_groups=5)
    with pytest.raises(ValueError, match="exceeds the 4 experts"):
        make(top_k=5)
    with pytest.raises(ValueError, match="two best"):
        make(num_groups=8, topk_groups=2)
    assert make().e_score_correction_bias.dtype == torch.float32
