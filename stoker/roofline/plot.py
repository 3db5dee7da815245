"""Log-log roofline PNG: roofs, every op of every batch placed, the batch sweep, a measured point.

matplotlib is imported inside `plot_roofline` only (Agg backend), so the package stays light.
"""

from __future__ import annotations

from pathlib import Path

from stoker.roofline.costmodel import StepCost, compute_dtype
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec

_OP_MARKERS = {"qkv_proj": "o", "o_proj": "s", "mlp_gate_up": "^", "mlp_down": "v", "lm_head": "D",
               "attention": "X", "router": "P"}
_OP_COLORS = {"qkv_proj": "tab:blue", "o_proj": "tab:cyan", "mlp_gate_up": "tab:green", "mlp_down": "tab:olive",
              "lm_head": "tab:purple", "attention": "tab:red", "router": "tab:pink"}


def plot_roofline(path: str | Path, gpu: GPUSpec, steps: list[StepCost], *, title: str,
                  eff: Efficiencies | None = None, measured: dict[str, float] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eff = eff or Efficiencies()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [3, 2]})
    bw = gpu.hbm_bytes_per_s
    x = [10 ** (i / 20) for i in range(-20, 81)]  # 0.1 .. 1e4 FLOP/B
    dtypes = ["bf16"] + sorted({compute_dtype(s.weight_dtype, gpu) for s in steps} - {"bf16"})
    for dt, style in zip(dtypes, ("-", "--")):
        peak = gpu.peak_flops(dt)
        ax.plot(x, [min(peak, a * bw) / 1e12 for a in x], "k" + style, lw=2,
                label=f"{dt} roof: {peak / 1e12:.0f} TFLOP/s, {gpu.hbm_gb_per_s:.0f} GB/s (ridge {peak / bw:.0f})")
    peak = gpu.peak_flops(dtypes[-1])
    ax.plot(x, [min(peak * eff.gemm_compute, a * bw * eff.memory) / 1e12 for a in x], color="0.6", ls=":",
            label=f"achievable ({eff.memory:.0%} BW, {eff.gemm_compute:.0%} FLOP/s)")
    seen: set[str] = set()
    for s in steps:
        for op in s.ops:
            if op.op_class not in ("gemm", "attention") or op.flops == 0:
                continue
            label = op.name if op.name not in seen else None
            seen.add(op.name)
            ax.scatter(op.arithmetic_intensity, op.flops / op.time_s / 1e12, s=40, alpha=0.7, facecolors="none",
                       marker=_OP_MARKERS.get(op.name, "o"),
                       edgecolors=_OP_COLORS.get(op.name, "0.3"), label=label, zorder=3)
    sweep = [(s.arithmetic_intensity, s.flops / s.step_time_s / 1e12) for s in steps]
    ax.plot(*zip(*sweep), "o-", color="tab:orange", ms=8, lw=2, label="whole step, batch sweep", zorder=4)
    for s, (ai, tf) in zip(steps, sweep):
        ax.annotate(f"b={s.batch}", (ai, tf), textcoords="offset points", xytext=(6, -12), fontsize=9)
    if measured:
        ai = measured["achieved_tflops"] * 1e12 / (measured["achieved_gb_per_s"] * 1e9)
        ax.scatter(ai, measured["achieved_tflops"], marker="*", s=300, color="gold", edgecolor="k", zorder=5,
                   label=f"measured: MBU {measured['mbu']:.0%}, MFU {measured['mfu']:.1%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(0.3, 1e4)
    ax.set_ylim(max(0.01, min(t for _, t in sweep) / 20), gpu.peak_flops(dtypes[-1]) / 1e12 * 2)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of HBM traffic)")
    ax.set_ylabel("attained TFLOP/s per GPU")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=11)

    batches = [s.batch for s in steps]
    ax2.plot(batches, [s.tokens_per_s for s in steps], "o-", color="tab:orange", label="predicted")
    ax2.plot(batches, [s.ceiling_tokens_per_s for s in steps], "k--", label="roofline ceiling")
    if measured:
        ax2.scatter(measured["batch"], measured["measured_tokens_per_s"], marker="*", s=300, color="gold",
                    edgecolor="k", zorder=5, label="measured")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("batch (sequences per step)")
    ax2.set_ylabel(f"{steps[0].phase} tokens/s (TP group)")
    ax2.grid(True, which="both", alpha=0.25)
    ax2.legend(fontsize=9)
    ax2.set_title("throughput vs batch", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
