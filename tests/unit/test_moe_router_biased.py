"""gpt-oss's router against a float64 reading of it: top-k of the logits (bias included),
softmax over those k only; ties go to the lower expert."""

from __future__ import annotations

import pytest
import torch

from stoker.layers.moe_router import BiasedTopKRouter
from stoker.layers.weight_method import TorchLinearMethod


def router(h: int, e: int, k: int) -> BiasedTopKRouter:
    r = BiasedTopKRouter(h, e, k)
    r.attach(TorchLinearMethod())
    return r


@pytest.mark.parametrize("e, k", [(8, 2), (4, 4), (32, 4)])
def test_matches_float64(e: int, k: int) -> None:
    g = torch.Generator().manual_seed(e + k)
    r = router(16, e, k)
    with torch.no_grad():
        r.weight.copy_(torch.randn(e, 16, generator=g))
        r.bias.copy_(torch.randn(e, generator=g))
    x = torch.randn(50, 16, generator=g)
    w, ids = r.route(x)
    logits = x.double() @ r.weight.double().T + r.bias.double()
    for t in range(50):
        top = sorted(range(e), key=lambda i: (-logits[t, i].item(), i))[:k]
        assert ids[t].tolist() == top
        want = torch.softmax(logits[t, top], dim=0)
        assert w[t].tolist() == pytest.approx(want.tolist(), rel=1e-5)
    assert w.dtype == torch.float32


def test_the_bias_picks_and_ties_go_low() -> None:
    r = router(4, 4, 2)
    with torch.no_grad():
        r.weight.zero_()
        r.bias.copy_(torch.tensor([0.0, 1.0, 1.0, 1.0]))
    w, ids = r.route(torch.randn(3, 4))
    assert ids.tolist() == [[1, 2]] * 3
    assert w.tolist() == [[0.5, 0.5]] * 3
