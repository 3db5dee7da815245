"""ExpertLoad: per-layer balancedness (mean / max tokens per expert, vLLM's EPLB figure), the
interval between two reads, and the engine line's words."""

from __future__ import annotations

import pytest

from stoker.core.expert_load import ExpertLoad


def test_balancedness_and_totals() -> None:
    load = ExpertLoad({0: (4, 4, 4, 4), 3: (16, 0, 0, 0), 5: (0, 0, 0, 0)})
    assert load.balancedness(0) == 1.0 and load.balancedness(3) == 0.25  # even; one expert took all (1/E)
    assert load.balancedness(5) is None and load.total(3) == 16
    assert load.summary() == "MoE balancedness 0.62 (worst layer 3: 0.25)"
    assert ExpertLoad({1: (0, 0)}).summary() is None


def test_since_gives_the_interval() -> None:
    earlier = ExpertLoad({0: (1, 2), 2: (3, 3)})
    later = ExpertLoad({0: (5, 2), 2: (3, 7)})
    assert later.since(earlier).tokens == {0: (4, 0), 2: (0, 4)}
    assert later.since(None) is later
    assert later.since(earlier).balancedness(0) == pytest.approx(0.5)
