"""The saved result (one JSON per run) and the printed summary.

Key names follow vLLM's `bench serve` result files (`request_throughput`,
`output_throughput`, `mean_ttft_ms`, `p99_tpot_ms`, ...) so tools written for those files
read ours; `stoker roofline --measured` reads `output_throughput`, `total_token_throughput`,
`request_throughput`, `max_concurrency`, `model_id` and `hardware` from here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from stoker.bench import server_wall
from stoker.bench.metrics import BenchMetrics, percentile_key
from stoker.bench.runner import LoadConfig, RunOutcome

_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _num(x: float) -> float | str:
    """JSON has no inf: an unbounded request rate is saved as the string "inf" (like vLLM)."""
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def build_result(*, metrics: BenchMetrics, outcome: RunOutcome, load: LoadConfig,
                 meta: dict[str, Any]) -> dict[str, Any]:
    """One run's JSON: run settings, metrics, and every per-request timing.

    `meta` carries what the caller knows: command, base_url, endpoint, model_id, dataset,
    tokenizer_id, models (the /v1/models answer), token-count sources, hardware, roofline.
    """
    from stoker import __version__

    results = outcome.results
    # Output lengths as the metrics counted them (usage, re-tokenized or chunks), 0 if failed.
    counted = iter(metrics.output_lens)
    output_lens = [next(counted) if r.success else 0 for r in results]
    out: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "stoker_version": __version__,
        **meta,
        "request_rate": _num(load.request_rate),
        "burstiness": _num(load.burstiness),
        "max_concurrency": load.max_concurrency,
        "request_timeout": load.request_timeout,
        "seed": load.seed,
        "num_prompts": len(results),
    }
    out.update(metrics.as_dict())
    # Per-request timings, parallel arrays in send order (vLLM's names where they exist).
    out.update({
        "input_lens": [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in results],
        "output_lens": output_lens,
        "ttfts": [r.ttft if r.success else None for r in results],
        "e2els": [r.latency if r.success else None for r in results],
        "itls": [r.itl for r in results],
        "start_times": [r.start for r in results],
        "end_times": [r.end for r in results],
        "errors": [r.error for r in results],
        "error_reasons": [r.error_reason for r in results],
    })
    return out


def save_result(path: str | Path, result: dict[str, Any]) -> Path:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a NaN/inf sneaking in should fail here, not in someone's JSON parser.
    p.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return p


def _fmt(v: object, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


WIDTH = 50


def report_head(title: str, result: dict[str, Any]) -> tuple[list[str], Any]:
    """The report's title and the rows every mode starts with (counts, failures by reason, the
    load asked for, duration); returns (lines, row) for the mode to go on with."""
    lines = [f" {title} ".center(WIDTH, "=")]

    def row(name: str, value: object, digits: int = 2) -> None:
        lines.append(f"{name:<40} {_fmt(value, digits):<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    for reason, n in result["failures"].items():
        row(f"  {reason}:", n)
    row("Request rate (req/s, target):", result["request_rate"])
    row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    return lines, row


def format_report(result: dict[str, Any], percentiles: list[float]) -> str:
    """The human summary, laid out like vLLM's so eyes trained on it find things."""
    w = WIDTH
    lines, row = report_head("Serving Benchmark Result", result)
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Mean concurrent requests:", result["mean_concurrency"])
    for metric, title in _TITLES.items():
        lines.append(title.center(w, "-"))
        name = metric.upper()
        row(f"Mean {name} (ms):", result.get(f"mean_{metric}_ms"))
        row(f"Median {name} (ms):", result.get(f"median_{metric}_ms"))
        row(f"Std {name} (ms):", result.get(f"std_{metric}_ms"))
        for p in percentiles:
            key = percentile_key(p)
            row(f"{key.upper()} {name} (ms):", result.get(f"{key}_{metric}_ms"))
    roof = result.get("roofline")
    if roof:
        lines.append(f"Roofline ({result.get('hardware')})".center(w, "-"))
        for k in ("mbu", "mfu"):
            if roof.get(k) is not None:
                row(f"Decode {k.upper()} implied (%):", 100.0 * roof[k])
        for k in ("achieved_gb_per_s", "achieved_tflops", "predicted_tokens_per_s"):
            if roof.get(k) is not None:
                row(f"{k}:", roof[k])
    wall = result.get("server_wall")
    if wall:
        lines.append("Server wall".center(w, "-"))
        lines += server_wall.describe(wall)
    lines.append("=" * w)
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def command_line(args: argparse.Namespace) -> str:
    """The command line as typed when run from a shell; otherwise (called in-process, e.g.
    from Python or a test) an equivalent command rebuilt from the parsed flags."""
    argv = sys.argv[1:]
    if "bench" in argv and getattr(args, "bench_command", None) in argv:
        return shlex.join(["stoker", *argv[argv.index("bench"):]])
    words = ["stoker", "bench", str(getattr(args, "bench_command", "serve"))]
    for key, value in vars(args).items():
        if key in ("func", "command", "bench_command") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags, JSON-safe (strict JSON has no Infinity: inf is saved as "inf")."""
    def safe(v: Any) -> Any:
        return str(v) if isinstance(v, float) and not math.isfinite(v) else v

    return {k: safe(v) for k, v in vars(args).items() if k != "func" and not callable(v)}
