"""Sweep plot: latency percentiles against achieved output throughput (one PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stoker.bench.metrics import percentile_key

_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))


def plot_sweep(runs: Sequence[dict[str, Any]], path: str | Path, *, title: str = "",
               percentiles: Sequence[float] = (50, 90, 99)) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    # x: the throughput each run achieved, so the curve shows where latency turns up.
    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    x = [r["output_throughput"] for r in ordered]
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(15, 4.5), constrained_layout=True)
    for ax, (metric, name) in zip(axes, _PANELS):
        for p in percentiles:
            key = f"{percentile_key(p)}_{metric}_ms"
            pts = [(xi, r.get(key)) for xi, r in zip(x, ordered) if r.get(key) is not None]
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=f"p{p:g}")
        for xi, r in zip(x, ordered):
            y = r.get(f"{percentile_key(percentiles[0])}_{metric}_ms")
            if y is not None:
                ax.annotate(r.get("label", ""), (xi, y), textcoords="offset points", xytext=(4, -10),
                            fontsize=7, color="0.35")
        ax.set_ylim(bottom=0)  # from zero, so small wiggles don't read as big changes
        ax.set_title(name)
        ax.set_xlabel("achieved output throughput (output tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # e.g. every run failed, or all outputs were one token (no TPOT)
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
    if title:
        fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
