"""The loss curve PNG from HF Trainer's `log_history`. [no torch]

matplotlib is imported inside `plot_loss_curve` only (Agg backend: no display on a training box).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from stoker.finetune.output_dir import write_atomically


def loss_points(log_history: list[dict[str, Any]]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, eval) as (step, loss) pairs. Trainer logs train loss under "loss", eval under "eval_loss"."""
    train = [(int(e["step"]), float(e["loss"])) for e in log_history if "loss" in e and "step" in e]
    evals = [(int(e["step"]), float(e["eval_loss"])) for e in log_history if "eval_loss" in e and "step" in e]
    return train, evals


def plot_loss_curve(log_history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = loss_points(log_history)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.5)
    if evals:
        ax.plot(*zip(*evals), label="eval loss", color="tab:orange", marker="o", markersize=4, linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss on assistant / completion tokens (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if train or evals:
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_atomically(path, buf.getvalue())
