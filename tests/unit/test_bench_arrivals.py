"""Arrival schedule: gamma gaps with the asked mean rate and CV = 1 / sqrt(burstiness)."""

from __future__ import annotations

import math
import statistics

import pytest

from stoker.bench.arrivals import arrival_offsets, gaps

N = 20_000  # relative std error of the mean gap <= 1.5 %, of the CV <= ~1.5 %; tolerance 5 %


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_mean_rate_and_cv(burstiness: float) -> None:
    rate = 10.0
    g = gaps(arrival_offsets(N, rate, burstiness, seed=1234))
    mean = statistics.fmean(g)
    cv = statistics.pstdev(g) / mean
    assert 1 / mean == pytest.approx(rate, rel=0.05)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_schedule_shape_and_seed() -> None:
    a = arrival_offsets(100, 5.0, 1.0, seed=7)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a == arrival_offsets(100, 5.0, 1.0, seed=7)
    assert a != arrival_offsets(100, 5.0, 1.0, seed=8)


def test_infinite_rate_and_constant_rate() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(4, 2.0, math.inf) == [0.0, 0.5, 1.0, 1.5]


@pytest.mark.parametrize("rate, b, flag", [(0, 1, "--request-rate"), (-1, 1, "--request-rate"),
                                           (float("nan"), 1, "--request-rate"), (1, 0, "--burstiness")])
def test_invalid(rate: float, b: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        arrival_offsets(3, rate, b)
