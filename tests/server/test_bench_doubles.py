"""The load generator against its own test doubles on 127.0.0.1: success paths, every
failure reason, concurrency caps, the saved JSON, sweep (table + JSON + PNG) and compare."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from stoker.bench.client import Endpoint, RequestSpec
from stoker.bench.doubles import DoubleServer
from stoker.bench.metrics import compute_metrics
from stoker.bench.runner import LoadConfig, auth_headers, run_load
from stoker.cli import main


def _endpoint(server: DoubleServer, chat: bool = False, **kw: object) -> Endpoint:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Endpoint(url=server.base_url + path, model=server.model, chat=chat, headers=auth_headers(None), **kw)


def _run(server: DoubleServer, n: int = 6, max_tokens: int = 5, chat: bool = False, **load: object):
    specs = [RequestSpec("a b c", 3, max_tokens)] * n
    return asyncio.run(run_load(_endpoint(server, chat), specs, LoadConfig(**load)))


@pytest.mark.parametrize("chat", [False, True])
def test_instant_stream_is_counted_exactly(chat: bool) -> None:
    with DoubleServer("instant") as srv:
        out = _run(srv, n=8, max_tokens=7, chat=chat)
    m = compute_metrics(out.results, out.duration)
    assert (m.completed, m.failed) == (8, 0)
    assert m.output_lens == [7] * 8 and m.total_input_tokens == 24  # usage.prompt_tokens
    for r in out.results:
        assert r.success and 0 < r.ttft <= r.latency and r.num_chunks == 7 and len(r.itl) == 6
        assert r.start <= r.end


@pytest.mark.parametrize("mode, reason", [
    ("http_error", "http_500"), ("sse_error", "sse_error"), ("empty", "no_content"),
    ("truncated", "truncated_stream"), ("hang", "timeout"),
])
def test_each_misbehaviour_is_a_failure_with_its_reason(mode: str, reason: str) -> None:
    with DoubleServer(mode, hang_s=5.0) as srv:
        out = _run(srv, n=4, request_timeout=0.5)
    m = compute_metrics(out.results, out.duration)
    assert (m.completed, m.failed, m.failures) == (0, 4, {reason: 4})
    assert m.summaries["ttft"].count == 0 and m.total_output_tokens == 0
    assert all(r.error for r in out.results)


def test_mixed_failures_add_up_and_stay_out_of_latency() -> None:
    with DoubleServer("mixed", hang_s=5.0) as srv:
        out = _run(srv, n=10, max_concurrency=1, request_timeout=0.5)
    m = compute_metrics(out.results, out.duration)
    assert m.completed + m.failed == 10
    assert m.failures == {"http_500": 2, "no_content": 2, "sse_error": 2, "timeout": 2}
    assert m.summaries["e2el"].count == m.completed == 2
    assert m.summaries["e2el"].percentiles[99] < 100.0  # the 500 ms timeouts are not in it


def test_no_usage_falls_back_to_chunks_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with DoubleServer("nousage") as srv:
        rc = main(["bench", "serve", "--base-url", srv.base_url, "--num-prompts", "3",
                   "--random-input-len", "4", "--random-output-len", "6", "--disable-tqdm",
                   "--save-result", str(tmp_path / "r.json")])
    assert rc == 0
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["output_tokens_source"] == "chunks" and d["input_tokens_source"] == "estimate"
    assert d["total_output_tokens"] == 18
    assert "content chunks" in capsys.readouterr().out


def test_max_concurrency_caps_in_flight() -> None:
    with DoubleServer("instant", token_delay_s=0.005) as srv:
        out = _run(srv, n=9, max_tokens=4, max_concurrency=3)
    m = compute_metrics(out.results, out.duration)
    assert m.completed == 9 and m.max_concurrent_requests == 3


def test_request_rate_spreads_sends() -> None:
    with DoubleServer("instant") as srv:
        out = _run(srv, n=10, request_rate=50.0, burstiness=math.inf)  # one send every 20 ms
    starts = sorted(r.start for r in out.results)
    assert starts[-1] == pytest.approx(0.18, abs=0.03)
    assert out.duration >= 0.18


def test_serve_cli_saves_everything(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "sub" / "run.json"
    with DoubleServer("instant", model="demo") as srv:
        rc = main(["bench", "serve", "--base-url", srv.base_url + "/v1", "--endpoint", "chat",
                   "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "5",
                   "--ignore-eos", "--max-concurrency", "4", "--goodput", "ttft:1000", "e2el:2000",
                   "--percentiles", "50,99.9", "--disable-tqdm", "--save-result", str(path)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P99.9 TTFT (ms)" in printed
    d = json.loads(path.read_text())
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99.9_ttft_ms", "p50_tpot_ms", "mean_itl_ms", "p50_e2el_ms",
                "max_concurrency", "num_prompts", "completed", "failed", "request_goodput",
                "max_concurrent_requests", "stoker_version", "date", "command", "models", "model_id",
                "hardware", "ttfts", "itls", "e2els", "start_times", "input_lens", "output_lens"):
        assert key in d, key
    assert d["model_id"] == "demo" and d["models"]["data"][0]["id"] == "demo"
    assert d["backend"] == "openai-chat" and d["max_concurrency"] == 4 and d["request_rate"] == "inf"
    assert d["completed"] == d["num_prompts"] == 12 and d["output_lens"] == [5] * 12
    assert d["max_concurrent_requests"] <= 4 and d["request_goodput"] > 0
    assert "bench serve" in d["command"]
    assert all(t <= e for t, e in zip(d["ttfts"], d["e2els"]))


def test_serve_cli_exit_codes(capsys: pytest.CaptureFixture) -> None:
    with DoubleServer("http_error") as srv:
        assert main(["bench", "serve", "--base-url", srv.base_url, "--num-prompts", "2",
                     "--random-input-len", "2", "--disable-tqdm"]) == 1  # nothing succeeded
        assert main(["bench", "serve", "--base-url", srv.base_url, "--request-rate", "0"]) == 2
        assert main(["bench", "serve", "--base-url", srv.base_url, "--goodput", "itl:5"]) == 2
        assert main(["bench", "serve", "--base-url", srv.base_url, "--endpoint", "images"]) == 2
        port = srv.port
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert "--request-rate" in err and "--goodput" in err and "--endpoint" in err and "cannot reach" in err


def test_sweep_table_json_png_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep.json"
    args = ["--num-prompts", "12", "--random-input-len", "4", "--random-output-len", "6", "--disable-tqdm"]
    # A double with a 4-stream batch cap and 2 ms per token behaves like a small server.
    with DoubleServer("instant", token_delay_s=0.002, max_running=4) as srv:
        rc = main(["bench", "sweep", "--base-url", srv.base_url, "--num-rates", "2", *args,
                   "--save-result", str(out)])
        assert rc == 0
        single = tmp_path / "single.json"
        assert main(["bench", "serve", "--base-url", srv.base_url, *args, "--save-result", str(single)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p99" in printed and "sync" in printed and "max" in printed
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]][0] == "sync" and doc["runs"][-1]["label"] == "max"
    assert len(doc["runs"]) == 4 and doc["stopped_early"] is None
    assert doc["runs"][0]["max_concurrent_requests"] == 1
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    assert main(["bench", "compare", str(out), str(out)]) == 0
    text = capsys.readouterr().out
    assert "== A: sync" in text and "1.000" in text
    assert main(["bench", "compare", str(single), str(single)]) == 0
    assert "output_throughput" in capsys.readouterr().out
    assert main(["bench", "compare", str(single), str(out)]) == 2


def test_sweep_stops_early_on_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "s.json"
    with DoubleServer("http_error") as srv:
        rc = main(["bench", "sweep", "--base-url", srv.base_url, "--num-prompts", "3",
                   "--random-input-len", "2", "--disable-tqdm", "--save-result", str(out)])
    assert rc == 1
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 1 and "synchronous" in doc["stopped_early"]
    assert "stopped early" in capsys.readouterr().out


def test_roofline_link(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("stoker.roofline.measured")
    out = tmp_path / "r.json"
    base = ["--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]
    with DoubleServer("instant") as srv:
        assert main(["bench", "serve", "--base-url", srv.base_url, *base, "--hardware", "H100-SXM",
                     "--model-config", "llama-3-8b", "--save-result", str(out)]) == 0
        assert "Decode MBU implied (%)" in capsys.readouterr().out
        roof = json.loads(out.read_text())["roofline"]
        assert roof["mbu"] > 0 and roof["mfu"] > 0 and roof["inputs"]["context_len"] == pytest.approx(8 + 4 / 2)
        sent_before = sum(srv.stats.values())
        assert main(["bench", "serve", "--base-url", srv.base_url, *base, "--hardware", "H999",
                     "--model-config", "llama-3-8b"]) == 2
        assert sum(srv.stats.values()) == sent_before  # refused before any load was sent
    assert "unknown GPU" in capsys.readouterr().err


def test_a_kept_alive_connection_the_server_dropped_is_resent_once() -> None:
    """llama-server closes each connection after a streamed response without saying so; the
    next request on the pooled connection gets no answer and is sent again on a new one, so
    every request succeeds and none is served twice."""
    with DoubleServer("instant", close_reused=True) as srv:
        out = _run(srv, n=4, max_tokens=3, max_concurrency=1)
        dropped, served = srv.stats["dropped_on_reused_connection"], srv.stats["instant"]
    assert [r.success for r in out.results] == [True] * 4 and served == 4
    assert dropped >= 1  # the pooled connection was reused (and dropped) at least once
    assert all(r.http_status == 200 for r in out.results)
