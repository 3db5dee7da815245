"""The server's own wall verdict over a benchmark run, beside the client's TTFT/TPOT (issue 16).

`stoker serve` counts every step by kind and wall, with measured and predicted seconds and the
modelled FLOPs and bytes (server/observe/wall_metrics.py). Scraping `/metrics` before and after a run
and differencing those counters gives the verdict of exactly the run's steps: per step kind,
the share of steps against each wall, MBU and MFU (modelled bytes and FLOPs over measured step
time, divided by the ceilings the server names), and measured / predicted step time.

A server without these counters (vLLM, or Stoker with no device model) gives
{"available": False, "why": ...}: the run's result says so instead of showing zeros.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(root_url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> Samples | None:
    """Every sample of GET /metrics as {(name, sorted labels): value}; None if unreachable."""
    req = urllib.request.Request(root_url.rstrip("/") + "/metrics", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _by_kind(samples: Samples, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            kind = dict(labels).get("kind", "")
            out[kind] = out.get(kind, 0.0) + v
    return out


def _single(samples: Samples, name: str) -> float | None:
    return next((v for (n, _), v in samples.items() if n == name), None)


def wall_over_run(before: Samples | None, after: Samples | None) -> dict[str, Any]:
    if before is None or after is None:
        return {"available": False, "why": "the server's /metrics could not be read"}
    info = next((dict(labels) for (n, labels), _ in after.items() if n == "stoker:wall_info"), None)
    peak_bytes = _single(after, "stoker:ceiling_bytes_per_second")
    peak_flops = _single(after, "stoker:ceiling_flops_per_second")
    if info is None or not peak_bytes or not peak_flops:
        return {"available": False, "why": "the server exports no wall verdict (not Stoker, or no device model: "
                                           "see `stoker serve` logs)"}

    def delta(name: str) -> dict[str, float]:
        a, b = _by_kind(after, name), _by_kind(before, name)
        return {k: a[k] - b.get(k, 0.0) for k in a}

    seconds, predicted = delta("stoker:step_seconds_total"), delta("stoker:step_predicted_seconds_total")
    flops, nbytes = delta("stoker:step_flops_total"), delta("stoker:step_bytes_total")
    walls: dict[str, dict[str, float]] = {}
    for (n, labels), v in after.items():
        if n == "stoker:step_bound_total":
            d = dict(labels)
            steps = v - before.get((n, labels), 0.0)
            if steps > 0:
                walls.setdefault(d["kind"], {})[d["wall"]] = steps
    kinds: dict[str, Any] = {}
    for kind, s in seconds.items():
        if s <= 0:
            continue
        num_steps = sum(walls.get(kind, {}).values())
        kinds[kind] = {
            "steps": num_steps,
            "wall_share": {w: n / num_steps for w, n in sorted(walls.get(kind, {}).items())} if num_steps else {},
            "seconds": s,
            "mbu": nbytes.get(kind, 0.0) / s / peak_bytes,
            "mfu": flops.get(kind, 0.0) / s / peak_flops,
            "measured_over_predicted": s / predicted[kind] if predicted.get(kind) else None,
        }
    return {"available": True, "device": info.get("device"), "profile": info.get("profile"),
            "weight_dtype": info.get("weight_dtype"), "kv_dtype": info.get("kv_dtype"), "tp": info.get("tp"),
            "ceiling_bytes_per_s": peak_bytes, "ceiling_flops_per_s": peak_flops, "kinds": kinds}


def describe(wall: dict[str, Any]) -> list[str]:
    """Lines for the report: "decode: 93% of steps memory-bound, MBU 41%, MFU 3%, 1.12x of prediction"."""
    if not wall.get("available"):
        return [f"server wall: {wall.get('why', 'not available')}"]
    lines = [f"server wall ({wall['device']}, {wall['profile']} profile, {wall['weight_dtype']} weights):"]
    for kind, k in wall["kinds"].items():
        share = k["wall_share"]
        top = max(share, key=share.__getitem__) if share else "?"
        ratio = k["measured_over_predicted"]
        lines.append(f"  {kind}: {k['steps']:.0f} steps, {100 * share.get(top, 0):.0f}% {top}-bound, "
                     f"MBU {100 * k['mbu']:.1f}%, MFU {100 * k['mfu']:.1f}%"
                     + (f", {ratio:.2f}x of prediction" if ratio else ""))
    return lines
