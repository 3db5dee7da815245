"""CLI registration, compare's ratios, the progress line, the report layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.bench.client import LiveCounters
from stoker.bench.compare import compare, metric_rows, ratio
from stoker.bench.progress import BenchProgress
from stoker.bench.runner import api_root, endpoint_path
from stoker.bench.sweep import sweep_rates
from stoker.cli import build_parser, main


def test_bench_subcommands_registered() -> None:
    parser = build_parser()
    for cmd in ("serve", "sweep", "compare"):
        args = parser.parse_args(["bench", cmd] + (["a.json", "b.json"] if cmd == "compare" else []))
        assert callable(args.func)
    args = parser.parse_args(["bench", "serve", "--request-rate", "inf", "--burstiness", "0.5",
                              "--goodput", "ttft:100", "tpot:20", "--max-concurrency", "8"])
    assert args.request_rate == float("inf") and args.goodput == ["ttft:100", "tpot:20"]


def test_import_stays_light() -> None:
    code = ("import sys, stoker.bench.cli; "
            "print(sorted(m for m in ('torch', 'aiohttp', 'matplotlib', 'rich', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_url_and_endpoint_normalisation() -> None:
    assert api_root("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert endpoint_path("chat") == ("/v1/chat/completions", True)
    assert endpoint_path("/v1/completions") == ("/v1/completions", False)
    with pytest.raises(ValueError, match="--base-url"):
        api_root("127.0.0.1:8000")
    with pytest.raises(ValueError, match="--endpoint"):
        endpoint_path("embeddings")


def test_sweep_rates_between_sync_and_max() -> None:
    assert sweep_rates(1.0, 5.0, 3) == pytest.approx([2.0, 3.0, 4.0])
    assert sweep_rates(5.0, 5.0, 3) == [] and sweep_rates(1.0, 5.0, 0) == []


def test_compare_ratios() -> None:
    a = {"output_throughput": 100.0, "mean_ttft_ms": 20.0, "failed": 0, "model_id": "m", "seed": 1}
    b = {"output_throughput": 150.0, "mean_ttft_ms": 10.0, "failed": 2, "model_id": "m", "seed": 2}
    rows = {k: r for k, _, _, r in metric_rows(a, b)}
    assert rows == {"output_throughput": 1.5, "mean_ttft_ms": 0.5, "failed": None}
    assert ratio(0, 3) is None
    text = compare(a, b)
    assert "1.500" in text and "higher better" in text and "lower better" in text


def test_compare_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"output_throughput": 10.0, "p99_e2el_ms": 400.0}))
    b.write_text(json.dumps({"output_throughput": 25.0, "p99_e2el_ms": 100.0}))
    assert main(["bench", "compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "2.500" in out and "0.250" in out
    (tmp_path / "x.json").write_text("[1]")
    assert main(["bench", "compare", str(a), str(tmp_path / "x.json")]) == 2
    assert main(["bench", "compare", str(a), str(tmp_path / "missing.json")]) == 2


def test_progress_line_counts() -> None:
    p = BenchProgress(total=10, enabled=False, counters=LiveCounters(sent=7, completed=5, failed=1, chunks=40))
    with p:
        text = p.render_text()
        p.render()  # the rich renderable builds without a terminal
    assert "sent 7/10" in text and "completed 5" in text and "failed 1" in text and "tok/s" in text
