"""MXFP4 experts on CPU (gpt-oss's checkpoints): one layer's routed experts through the C kernel
reading the 4-bit blocks (kernels/cpu/moe.c, `stoker_fused_moe_mxfp4_f32`) against the same
kernel on float32 panels of the dequantized weights and against the torch path
(`Mxfp4MoEMethod("dequant")`: each routed expert dequantized in torch per call).

    nice -n 5 python benchmarks/moe_mxfp4_cpu.py --threads 1 --rounds 3

Layer: gpt-oss-shaped, reduced (E 32, top-4, H 1024, I 1024; gpt-oss-20b has H = I = 2880),
clamped SwiGLU, expert biases, random weights quantized to MXFP4, softmax top-k of random
logits; every peer checked against the twin (reference.fused_moe on the dequantized weights)
before timing. Each round runs every peer in turn (medians of its calls, benchmarks/moe_cpu.py's
`time_calls`); the table gives the median of the rounds, ms per call, and the expert bytes
each representation holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.machine import cpu_model, isa  # noqa: E402
from benchmarks.moe_cpu import time_calls  # noqa: E402

LAYER = dict(num_experts=32, top_k=4, hidden=1024, inter=1024)
TOKENS = (1, 8, 64)


def peers(num_tokens: int) -> tuple[dict, dict[str, int]]:
    from stoker.kernels import reference
    from stoker.kernels.cpu import moe as cpu_moe
    from stoker.layers.activation import ClampedSwiGLU
    from stoker.layers.moe import FusedMoE
    from stoker.layers.moe_mxfp4 import Mxfp4MoEMethod
    from stoker.layers.moe_router import softmax_topk
    from stoker.quantization.formats import dequantize_mxfp4, quantize_mxfp4

    e, k, h, i = (LAYER[n] for n in ("num_experts", "top_k", "hidden", "inter"))
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5, torch.randn(e, h, i, generator=gen) / i**0.5
    b13, b2 = torch.randn(e, 2 * i, generator=gen) * 0.1, torch.randn(e, h, generator=gen) * 0.1
    (bl13, sc13), (bl2, sc2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    dq13, dq2 = dequantize_mxfp4(bl13, sc13), dequantize_mxfp4(bl2, sc2)
    x = torch.randn(num_tokens, h, generator=gen)
    weights, ids = softmax_topk(torch.randn(num_tokens, e, generator=gen), k, renormalize=True)
    act = ClampedSwiGLU()
    pb13, pb2 = cpu_moe.pack_expert_bias(b13), cpu_moe.pack_expert_bias(b2)
    p13, p2 = cpu_moe.pack_experts(dq13, dq2, False)
    layer = FusedMoE(e, h, i, activation=act, has_bias=True)
    layer.attach(Mxfp4MoEMethod("dequant"))
    with torch.no_grad():
        for name, t in (("w13_blocks", bl13), ("w13_scales", sc13), ("w2_blocks", bl2), ("w2_scales", sc2),
                        ("w13_bias", b13), ("w2_bias", b2)):
            getattr(layer, name).copy_(t)
    fns = {
        "c-mxfp4": lambda: cpu_moe.fused_moe_mxfp4(x, bl13, sc13, bl2, sc2, weights, ids, pb13, pb2, "swigluoai",
                                                   act.alpha, act.limit),
        "c-float32": lambda: cpu_moe.fused_moe(x, p13, p2, weights, ids, i, False, pb13, pb2, "swigluoai", act.alpha,
                                               act.limit),
        "torch-dequant": lambda: layer(x, weights, ids),
    }
    want = reference.fused_moe(x, dq13, dq2, weights, ids, act, b13, b2)
    for name, fn in fns.items():
        torch.testing.assert_close(fn(), want, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    nbytes = {"c-mxfp4": sum(t.numel() for t in (bl13, sc13, bl2, sc2)), "c-float32": 4 * (p13.numel() + p2.numel())}
    return fns, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {cpu_model()} ({isa()}), torch threads {torch.get_num_threads()}, layer {LAYER}")
    print("| tokens | c-mxfp4 | c-float32 | torch-dequant | c-float32 / c-mxfp4 | torch-dequant / c-mxfp4 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in TOKENS:
        fns, nbytes = peers(n)
        runs: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                runs[name].append(time_calls(fn)[0] * 1e3)
        med = {name: statistics.median(v) for name, v in runs.items()}
        print(f"| {n} | {med['c-mxfp4']:.2f} | {med['c-float32']:.2f} | {med['torch-dequant']:.2f} | "
              f"{med['c-float32'] / med['c-mxfp4']:.2f}x | {med['torch-dequant'] / med['c-mxfp4']:.2f}x |")
    print(f"# expert bytes held: mxfp4 {nbytes['c-mxfp4'] / 2**20:.1f} MiB, float32 panels "
          f"{nbytes['c-float32'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
