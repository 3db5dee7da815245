"""The rejection sampler keeps the target distribution: a chi-square test on a small vocabulary
that the tokens emitted at drafted positions follow p, for fixed seeds, and two planted bugs
(never resampling from the residual; accepting without the p test) that the same test fails."""

from __future__ import annotations

import pytest
import torch

from stoker.sampling import rejection
from stoker.sampling.rejection import VerifyGroup, verify
from stoker.sampling.sampler import Sampler, SamplingRow
from stoker.sampling_params import SamplingParams

VOCAB = 6
# Chi-square critical value for VOCAB - 1 = 5 degrees of freedom at significance 0.001
# (NIST/SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.4): a correct sampler exceeds
# it once in a thousand seeds; the test's seeds are fixed, so it passes or fails deterministically.
CHI2_5DOF_P001 = 20.515


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = p.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def _targets(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, VOCAB, generator=g) * 1.2  # (3, V) logits: rows p0, p1, p2 (bonus)


def _run(num_groups: int, drafts: tuple[int, int], seed: int, temperature: float = 1.0) -> tuple[torch.Tensor, list]:
    """num_groups sequences, each verifying the same two drafts against logits rows p0, p1, p2."""
    logits = _targets(seed).repeat(num_groups, 1)  # (3 * num_groups, V)
    params = SamplingParams(temperature=temperature)
    rows = [SamplingRow(params, [], [], 0, None, ()) for _ in range(logits.shape[0])]
    groups = [VerifyGroup(i, drafts) for i in range(num_groups)]
    out = verify(Sampler(seed, torch.device("cpu")), logits, rows, groups)
    return logits[:3], [out[i].token_ids for i in range(num_groups)]


def _check(seed: int, drafts: tuple[int, int]) -> tuple[float, float]:
    """(chi-square of the first emitted token vs p0, of the second, where the first draft was
    accepted, vs p1)."""
    logits, kept = _run(20_000, drafts, seed)
    p = logits.softmax(dim=-1)
    first = torch.tensor([t[0] for t in kept])
    second = torch.tensor([t[1] for t in kept if len(t) > 1])
    assert all(len(t) == 1 or t[0] == drafts[0] for t in kept)  # a second token only after an accepted draft
    assert len(second) > 1000  # enough accepted first drafts to test the second position
    return chi_square(first, p[0]), chi_square(second, p[1])


@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_the_target_distribution(seed: int) -> None:
    p = _targets(seed).softmax(dim=-1)
    # a likely draft (often accepted) and an unlikely one (often rejected and resampled)
    likely, unlikely = int(p[0].argmax()), int(p[1].argmin())
    for drafts in ((likely, int(p[1].argmax())), (likely, unlikely)):
        c0, c1 = _check(seed, drafts)
        assert c0 < CHI2_5DOF_P001 and c1 < CHI2_5DOF_P001, (drafts, c0, c1)


def test_a_planted_bug_never_resampling_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """On rejection, draw from p itself (the draft not removed): the draft comes out too often."""
    monkeypatch.setattr(rejection, "residual", lambda probs, draft_ids, has_draft: probs)
    p = _targets(0).softmax(dim=-1)
    c0, _ = _check(0, (int(p[0].argmax()), int(p[1].argmax())))
    assert c0 > CHI2_5DOF_P001


def test_a_planted_bug_accepting_without_the_p_test_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Sampler, "uniform", lambda self, generators: torch.zeros(len(generators)))
    p = _targets(0).softmax(dim=-1)
    logits, kept = _run(5000, (int(p[0].argmax()), int(p[1].argmax())), 0)
    assert chi_square(torch.tensor([t[0] for t in kept]), p[0]) > CHI2_5DOF_P001


def test_greedy_rows_keep_drafts_while_they_are_the_argmax() -> None:
    logits = torch.full((7, VOCAB), -5.0)
    for row, best in enumerate([2, 4, 1, 3, 0, 5, 1]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    rows = [SamplingRow(greedy, [], [], 0, None, ()) for _ in range(7)]
    # seq 0: drafts (2, 4, 0) vs argmaxes (2, 4, 1, 3): two kept, then 1 replaces 0
    # seq 1: drafts (0, 5) vs argmaxes (0, 5, 1): both kept and the bonus 1
    groups = [VerifyGroup(10, (2, 4, 0)), VerifyGroup(11, (0, 5))]
    out = verify(Sampler(0, torch.device("cpu")), logits, rows, groups)
    assert out[10].token_ids == [2, 4, 1] and out[11].token_ids == [0, 5, 1]
    assert len(out[10].logprobs) == 3 and out[10].top_logprobs == [None] * 3


def test_seeded_rows_reproduce() -> None:
    logits = _targets(3).repeat(50, 1)
    params = SamplingParams(temperature=1.0, seed=5)

    def once() -> list[list[int]]:
        gens = [torch.Generator().manual_seed(5 + i) for i in range(50)]
        rows = [SamplingRow(params, [], [], 0, gens[r // 3], ()) for r in range(150)]
        out = verify(Sampler(123, torch.device("cpu")), logits, rows, [VerifyGroup(i, (1, 2)) for i in range(50)])
        return [out[i].token_ids for i in range(50)]

    assert once() == once()
