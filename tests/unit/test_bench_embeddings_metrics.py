"""`bench serve --endpoint embeddings`: the metrics over per-request results, the server's
batch-size histogram differenced over a run, and the request body."""

from __future__ import annotations

import pytest

from stoker.bench.client import RequestResult, RequestSpec
from stoker.bench.embeddings import (
    EmbedEndpoint,
    IdsSpec,
    batch_sizes_over_run,
    compute_embed_metrics,
    format_embed_report,
    is_embeddings,
)


def _ok(start: float, end: float, inputs: int, tokens: int | None, prompt_len: int = 5) -> RequestResult:
    return RequestResult(success=True, start=start, end=end, latency=end - start, num_chunks=inputs,
                         prompt_tokens=tokens, prompt_len=prompt_len)


def test_metrics_add_up() -> None:
    results = [_ok(0.0, 0.1, 2, 20), _ok(0.0, 0.2, 2, 30), _ok(0.1, 0.4, 2, None, prompt_len=12),
               RequestResult(start=0.2, end=0.3).fail("http_503", "busy"),
               RequestResult(start=0.3, end=0.5).fail("timeout", "slow")]
    m = compute_embed_metrics(results, 2.0, percentiles=[50, 90, 99])
    assert (m.completed, m.failed) == (3, 2)
    assert m.failures == {"http_503": 1, "timeout": 1}
    assert m.total_inputs == 6 and m.total_input_tokens == 20 + 30 + 12
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(31.0)
    assert m.mean_input_len == pytest.approx(62 / 6)
    assert m.max_concurrent_requests == 2  # back-to-back requests never overlap (ends before starts)
    assert m.mean_concurrency == pytest.approx((0.1 + 0.2 + 0.3 + 0.1 + 0.2) / 2.0)
    # latencies of the successes only, in ms: 100, 200, 300; numpy-linear percentiles
    assert m.e2el.count == 3
    assert m.e2el.mean == pytest.approx(200.0) and m.e2el.median == pytest.approx(200.0)
    assert m.e2el.percentiles[90] == pytest.approx(280.0)
    assert m.e2el.percentiles[99] == pytest.approx(298.0)
    d = m.as_dict()
    for key in ("request_throughput", "total_token_throughput", "mean_e2el_ms", "median_e2el_ms",
                "p90_e2el_ms", "p99_e2el_ms", "completed", "failed", "failures", "input_throughput"):
        assert key in d
    assert not any("ttft" in k or "tpot" in k for k in d)


def test_no_success_gives_no_latency_and_bad_duration_refused() -> None:
    m = compute_embed_metrics([RequestResult(start=0, end=1).fail("connection_error", "x")], 1.0)
    assert m.completed == 0 and m.e2el.mean is None and m.mean_input_len == 0.0
    with pytest.raises(ValueError):
        compute_embed_metrics([], 0.0)


def _hist(name: str, model: str, buckets: dict[str, float], total: float) -> dict:
    out = {(f"{name}_bucket", tuple(sorted({"le": le, "model_name": model}.items()))): v for le, v in buckets.items()}
    out[(f"{name}_count", (("model_name", model),))] = buckets["+Inf"]
    out[(f"{name}_sum", (("model_name", model),))] = total
    return out


def test_batch_sizes_difference_of_histograms() -> None:
    name = "stoker:pooling_batch_size"
    before = {**_hist(name, "emb", {"1.0": 2, "4.0": 3, "8.0": 3, "+Inf": 3}, 6),
              **_hist(name, "other", {"1.0": 0, "4.0": 0, "8.0": 9, "+Inf": 9}, 60)}
    # during the run: 1 batch of 1, 2 batches of size in (1, 4] (3 and 4), 1 batch of 8
    after = {**_hist(name, "emb", {"1.0": 3, "4.0": 6, "8.0": 7, "+Inf": 7}, 6 + 1 + 3 + 4 + 8),
             **_hist(name, "other", {"1.0": 0, "4.0": 0, "8.0": 20, "+Inf": 20}, 200)}
    b = batch_sizes_over_run(before, after, "emb")
    assert b["available"] and b["metric"] == name
    assert b["batches"] == 4 and b["mean_batch_size"] == pytest.approx(16 / 4)
    assert b["batch_size_le"] == {"1": 1, "4": 2, "8": 1}


def test_batch_sizes_missing_is_said() -> None:
    assert not batch_sizes_over_run(None, {}, "m")["available"]
    b = batch_sizes_over_run({}, {("vllm:prompt_tokens_total", ()): 3.0}, "m")
    assert not b["available"] and "batch-size" in b["why"]
    text = format_embed_report({"completed": 1, "failed": 0, "failures": {}, "request_rate": "inf",
                                "max_concurrency": None, "duration": 1.0, "total_inputs": 1,
                                "total_input_tokens": 3, "request_throughput": 1.0, "input_throughput": 1.0,
                                "total_token_throughput": 3.0, "max_concurrent_requests": 1,
                                "mean_concurrency": 0.5, "mean_e2el_ms": 2.0, "p99_e2el_ms": 2.0,
                                "server_batch_sizes": b}, [99])
    assert "Embedding Benchmark Result" in text and "P99 E2EL (ms):" in text and "batch-size" in text


def test_endpoint_and_payload() -> None:
    assert is_embeddings("embeddings") and is_embeddings("/v1/embeddings") and not is_embeddings("chat")
    ep = EmbedEndpoint("http://h/v1/embeddings", "m", {}, inputs_per_request=3)
    assert ep.payload(RequestSpec("a b", 2, 1))["input"] == ["a b"] * 3
    assert ep.payload(IdsSpec("a b", 2, 1, (5, 6)))["input"] == [[5, 6]] * 3


def test_sweep_refuses_embeddings(capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import main

    assert main(["bench", "sweep", "--endpoint", "embeddings", "--base-url", "http://127.0.0.1:9"]) != 0
    assert "does not drive embeddings" in capsys.readouterr().err
