"""Metric arithmetic on synthetic timings, with exact expected values."""

from __future__ import annotations

import math

import pytest

from stoker.bench.client import RequestResult
from stoker.bench.metrics import (compute_metrics, parse_goodput, parse_percentiles, peak_concurrency,
                                  percentile, percentile_key)


def ok(start: float, ttft: float, latency: float, out: int | None, prompt_len: int, itl: list[float],
       chunks: int | None = None, text: str = "") -> RequestResult:
    return RequestResult(success=True, start=start, end=start + latency, ttft=ttft, latency=latency,
                         output_tokens=out, prompt_len=prompt_len, itl=itl,
                         num_chunks=chunks if chunks is not None else (out or 0), generated_text=text)


def failed(start: float, end: float, reason: str = "http_500") -> RequestResult:
    return RequestResult(success=False, error_reason=reason, start=start, end=end, prompt_len=99)


@pytest.fixture
def results() -> list[RequestResult]:
    return [
        ok(0.0, 0.1, 1.0, 10, 10, [0.1] * 9),  # TPOT 0.9 / 9 = 100 ms
        ok(0.5, 0.3, 2.0, 1, 20, []),  # one token: no TPOT statistic
        ok(1.0, 0.2, 1.0, 5, 30, [0.2] * 4),  # TPOT 0.8 / 4 = 200 ms
        failed(0.6, 0.7),  # excluded from every latency and token count
    ]


def test_percentile_matches_numpy_linear() -> None:
    assert percentile([1.0], 99) == 1.0
    assert percentile([100.0, 200.0, 300.0], 90) == pytest.approx(280.0)
    assert percentile([10.0, 20.0, 30.0, 40.0], 50) == pytest.approx(25.0)
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"


def test_counts_throughput_and_concurrency(results: list[RequestResult]) -> None:
    m = compute_metrics(results, 2.5, percentiles=[50, 90, 99])
    assert (m.completed, m.failed, m.failures) == (3, 1, {"http_500": 1})
    assert m.total_input_tokens == 60 and m.total_output_tokens == 16
    assert m.request_throughput == pytest.approx(3 / 2.5)
    assert m.output_throughput == pytest.approx(16 / 2.5)
    assert m.total_token_throughput == pytest.approx(76 / 2.5)
    assert m.max_concurrent_requests == 3  # at t=0.65: requests 1, 2 and the failed one
    assert m.mean_concurrency == pytest.approx((1.0 + 2.0 + 1.0 + 0.1) / 2.5)
    assert m.request_goodput is None  # no SLO asked, no goodput claimed


def test_latency_statistics(results: list[RequestResult]) -> None:
    d = compute_metrics(results, 2.5, percentiles=[50, 90, 99]).as_dict()
    assert d["mean_ttft_ms"] == pytest.approx(200.0)
    assert d["median_ttft_ms"] == pytest.approx(200.0)
    assert d["p90_ttft_ms"] == pytest.approx(280.0)
    assert d["p99_ttft_ms"] == pytest.approx(298.0)
    assert d["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    # TPOT only from multi-token outputs: [100, 200]
    assert d["mean_tpot_ms"] == pytest.approx(150.0)
    assert d["p90_tpot_ms"] == pytest.approx(190.0)
    assert d["mean_e2el_ms"] == pytest.approx(4000 / 3)
    assert d["median_e2el_ms"] == pytest.approx(1000.0)
    assert d["p99_e2el_ms"] == pytest.approx(1980.0)
    assert d["mean_itl_ms"] == pytest.approx((9 * 100 + 4 * 200) / 13)
    assert d["median_itl_ms"] == pytest.approx(100.0)


def test_one_token_outputs_have_no_tpot() -> None:
    m = compute_metrics([ok(0.0, 0.05, 0.05, 1, 5, [])], 1.0, goodput={"tpot": 1.0})
    assert m.summaries["tpot"].count == 0 and m.summaries["tpot"].mean is None
    assert m.request_goodput == pytest.approx(1.0)  # counts as TPOT 0: meets any TPOT SLO


@pytest.mark.parametrize("slo, good", [
    ({"ttft": 250}, 2), ({"tpot": 150}, 2), ({"e2el": 1500}, 2), ({"e2el": 1000}, 2),
    ({"ttft": 250, "tpot": 150}, 1), ({"ttft": 50}, 0), ({"ttft": 300, "tpot": 200, "e2el": 2000}, 3),
])
def test_goodput_each_slo(results: list[RequestResult], slo: dict[str, float], good: int) -> None:
    m = compute_metrics(results, 2.5, goodput=slo)
    assert m.request_goodput == pytest.approx(good / 2.5)


def test_all_failed_gives_no_latency_numbers() -> None:
    m = compute_metrics([failed(0, 1, "timeout"), failed(0, 1, "sse_error")], 1.0)
    assert (m.completed, m.failed) == (0, 2)
    assert m.failures == {"sse_error": 1, "timeout": 1}
    d = m.as_dict()
    assert d["mean_ttft_ms"] is None and d["p99_e2el_ms"] is None
    assert d["output_throughput"] == 0.0


def test_output_tokens_without_usage() -> None:
    r = ok(0.0, 0.1, 0.5, None, 3, [0.1] * 3, chunks=4, text="one two three four five six")
    assert compute_metrics([r], 1.0).total_output_tokens == 4  # content chunks
    m = compute_metrics([r], 1.0, count_tokens=lambda s: len(s.split()))
    assert m.total_output_tokens == 6  # re-tokenized text
    assert m.summaries["tpot"].mean == pytest.approx(400 / 5)


def test_peak_concurrency_back_to_back_is_one() -> None:
    rs = [RequestResult(start=0, end=1), RequestResult(start=1, end=2)]
    assert peak_concurrency(rs) == 1


def test_parse_flags() -> None:
    assert parse_goodput(["ttft:200", "TPOT:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    for bad in ("", "50,x", "0", "101"):
        with pytest.raises(ValueError, match="--percentiles"):
            parse_percentiles(bad)
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], 0.0)
