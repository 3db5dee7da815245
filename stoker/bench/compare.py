"""`stoker bench compare A.json B.json`: every shared numeric metric, and B / A.

Works on two `bench serve` results, or two sweeps (runs paired by position: sync with
sync, max with max, the k-th rate with the k-th rate). A ratio above 1 means B is larger:
better for throughputs, worse for latencies and failures, so the table says which is which.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

# Settings and bookkeeping, not measurements.
_SKIP = {"seed", "request_timeout", "num_prompts", "burstiness", "max_concurrency", "request_rate"}
_HIGHER_IS_BETTER = ("throughput", "goodput", "completed")


def load(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such result file: {path}")
    try:
        data = json.loads(p.read_text())
    except ValueError:
        raise ValueError(f"{path} is not JSON; pass files written by --save-result") from None
    if not isinstance(data, dict) or not ("runs" in data or "output_throughput" in data):
        raise ValueError(f"{path} is not a stoker bench result (no output_throughput or runs)")
    return data


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def ratio(a: float, b: float) -> float | None:
    return None if a == 0 else b / a


def metric_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float, float, float | None]]:
    return [(k, a[k], b[k], ratio(a[k], b[k])) for k, v in a.items()
            if k not in _SKIP and _is_num(v) and _is_num(b.get(k))]


def _direction(key: str) -> str:
    if any(w in key for w in _HIGHER_IS_BETTER):
        return "higher better"
    if key.endswith("_ms") or key in ("failed", "duration"):
        return "lower better"
    return ""


def format_rows(rows: list[tuple[str, float, float, float | None]]) -> str:
    lines = [f"{'metric':<28}{'A':>14}{'B':>14}{'B/A':>9}  "]
    for k, va, vb, r in rows:
        rs = "n/a" if r is None else f"{r:.3f}"
        lines.append(f"{k:<28}{va:>14.4g}{vb:>14.4g}{rs:>9}  {_direction(k)}")
    return "\n".join(lines)


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    if ("runs" in a) != ("runs" in b):
        raise ValueError("compare a single run with a single run, or a sweep with a sweep")
    if "runs" not in a:
        return format_rows(metric_rows(a, b))
    parts = []
    for ra, rb in zip(a["runs"], b["runs"]):
        parts.append(f"== A: {ra.get('label')}  vs  B: {rb.get('label')}")
        parts.append(format_rows(metric_rows(ra, rb)))
    if len(a["runs"]) != len(b["runs"]):
        parts.append(f"note: A has {len(a['runs'])} runs, B has {len(b['runs'])}; extra runs not compared")
    return "\n".join(parts)


def cmd_compare(args: argparse.Namespace) -> int:
    a, b = load(args.a), load(args.b)
    print(f"A = {args.a} ({a.get('model_id')} @ {a.get('base_url')}, {a.get('date')})")
    print(f"B = {args.b} ({b.get('model_id')} @ {b.get('base_url')}, {b.get('date')})")
    print(compare(a, b))
    return 0
