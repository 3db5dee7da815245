"""`stoker bench sweep`: the latency/throughput curve from idle to saturation.

Order of runs, and why: a synchronous run (one request at a time) gives the unloaded
latency floor; a max-throughput run (all requests at once, up to --max-concurrency) gives
the ceiling; then --num-rates request rates evenly spaced strictly between the two
request throughputs fill in the curve, ascending. Every run uses the same prompts.

Stopping early: if the synchronous run already fails more than --max-error-rate the server
is broken and nothing else is run; a failing max run still defines the range (lower rates
may be healthy); among the rate runs the first one over the limit ends the sweep, since
higher rates only fail more.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
from pathlib import Path
from typing import Any

from stoker.bench.report import save_result
from stoker.bench.runner import LoadConfig
from stoker.bench.serve import Prepared, prepare, run_once


def sweep_rates(sync_rps: float, max_rps: float, n: int) -> list[float]:
    """n rates evenly spaced strictly between the two measured request throughputs."""
    if n <= 0 or max_rps <= sync_rps:
        return []
    step = (max_rps - sync_rps) / (n + 1)
    return [sync_rps + step * k for k in range(1, n + 1)]


def _rate_label(rate: float) -> str:
    return f"{rate:.3g}/s" if rate < 1000 else f"{rate / 1000:.3g}k/s"


def error_rate(result: dict[str, Any]) -> float:
    n = result["num_prompts"]
    return result["failed"] / n if n else 0.0


def run_sweep(prep: Prepared, args: argparse.Namespace) -> tuple[list[dict[str, Any]], str | None]:
    """The runs in order of offered load, and why the sweep stopped early (None if it didn't)."""
    show = not args.disable_tqdm
    common = dict(seed=args.seed, request_timeout=args.request_timeout)
    runs: list[dict[str, Any]] = []
    sync = run_once(prep, LoadConfig(max_concurrency=1, **common), label="sync", show_progress=show)
    runs.append(sync)
    if error_rate(sync) > args.max_error_rate:
        return runs, f"the synchronous run failed {error_rate(sync):.0%} of its requests"
    peak = run_once(prep, LoadConfig(max_concurrency=args.max_concurrency, **common), label="max",
                    show_progress=show)
    runs.append(peak)
    for rate in sweep_rates(sync["request_throughput"], peak["request_throughput"], args.num_rates):
        load = LoadConfig(request_rate=rate, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, **common)
        result = run_once(prep, load, label=_rate_label(rate), show_progress=show)
        runs.append(result)
        if error_rate(result) > args.max_error_rate:
            stopped = f"the {result['label']} run failed {error_rate(result):.0%} of its requests"
            break
    else:
        stopped = None
    # Present the curve in order of offered load: sync, rates ascending, max.
    return [runs[0], *runs[2:], runs[1]], stopped


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def format_table(runs: list[dict[str, Any]]) -> str:
    head = (f"{'run':<14}{'req/s':>8}{'out tok/s':>11}{'conc':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT p50':>10}{'TPOT p99':>10}{'E2EL p50':>10}{'E2EL p99':>10}{'failed':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r['label']:<14}{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}"
            f"{r['mean_concurrency']:>7.1f}{_ms(r.get('p50_ttft_ms')):>10}{_ms(r.get('p99_ttft_ms')):>10}"
            f"{_ms(r.get('p50_tpot_ms')):>10}{_ms(r.get('p99_tpot_ms')):>10}"
            f"{_ms(r.get('p50_e2el_ms')):>10}{_ms(r.get('p99_e2el_ms')):>10}{r['failed']:>8}")
    lines.append("latencies in ms; out tok/s counts output tokens only; conc = mean requests in flight")
    return "\n".join(lines)


def cmd_sweep(args: argparse.Namespace) -> int:
    from stoker.bench.embeddings import is_embeddings

    if is_embeddings(args.endpoint):
        raise ValueError("bench sweep does not drive embeddings yet: run bench serve --endpoint embeddings "
                         "at each --request-rate / --max-concurrency")
    if args.num_rates < 0:
        raise ValueError(f"--num-rates must be >= 0, got {args.num_rates}")
    if not 0 <= args.max_error_rate <= 1:
        raise ValueError(f"--max-error-rate must be a fraction in [0, 1], got {args.max_error_rate}")
    if math.isnan(args.burstiness) or args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0 (1 = Poisson, inf = constant), got {args.burstiness}")
    if not hasattr(args, "request_rate"):
        args.request_rate = math.inf  # recorded in args; each run sets its own rate
    prep = prepare(args)
    runs, stopped = run_sweep(prep, args)
    from stoker import __version__

    doc = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "stoker_version": __version__,
        "kind": "sweep",
        **{k: prep.meta[k] for k in ("command", "args", "base_url", "endpoint", "model_id", "models",
                                     "dataset", "hardware")},
        "max_error_rate": args.max_error_rate,
        "stopped_early": stopped,
        "runs": runs,
    }
    print(format_table(runs))
    json_path = save_result(args.save_result, doc)
    png_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    from stoker.bench.plot import plot_sweep

    plot_sweep(runs, png_path, title=f"{prep.meta['model_id']} @ {prep.meta['base_url']}",
               percentiles=prep.percentiles)
    print(f"saved {json_path} and {png_path}")
    if stopped:
        print(f"note: sweep stopped early (--max-error-rate {args.max_error_rate:g}): {stopped}")
    return 0 if any(r["completed"] for r in runs) else 1
