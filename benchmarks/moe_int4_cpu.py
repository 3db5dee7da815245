"""int4 experts on CPU (AWQ / GPTQ / W4A16 / online int4 MoE checkpoints): one layer's routed
experts through the C kernel reading the 4-bit codes (kernels/cpu/moe.c,
`stoker_fused_moe_coded_f32` with 4-bit codes, `Int4MoEMethod`'s `cpu` backend) against the same kernel on float32
panels of the dequantized weights (what a float checkpoint runs, SiLU fused where it fits) and
against the torch path (`Int4MoEMethod("dequant")`: each routed expert dequantized per call).

    nice -n 5 python benchmarks/moe_int4_cpu.py --threads 1 --rounds 3

Layer: Qwen3-MoE-shaped, reduced (E 32, top-4, H 1024, I 768; Qwen3-30B-A3B has 128 experts,
top-8, H 2048, I 768), SiLU, random weights quantized as `--quantization int4` does (round to
nearest, symmetric, groups of 128), softmax top-k of random logits; every peer checked against
the twin (reference.fused_moe on the dequantized weights) before timing. Each round runs every
peer in turn (medians of its calls, benchmarks/moe_cpu.py's `time_calls`); the table gives the
median of the rounds, ms per call, and the expert bytes each representation holds.
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

LAYER = dict(num_experts=32, top_k=4, hidden=1024, inter=768)
TOKENS = (1, 8, 64)


def peers(num_tokens: int) -> tuple[dict, dict[str, int]]:
    from stoker.kernels import reference
    from stoker.kernels.cpu import linear as cpu_linear
    from stoker.kernels.cpu import moe as cpu_moe
    from stoker.layers.moe import FusedMoE
    from stoker.layers.moe_int4 import Int4MoEMethod
    from stoker.layers.moe_router import softmax_topk
    from stoker.quantization.config import online_config

    e, k, h, i = (LAYER[n] for n in ("num_experts", "top_k", "hidden", "inter"))
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5, torch.randn(e, h, i, generator=gen) / i**0.5
    scheme = online_config("int4").weights
    layers = {}
    for backend in ("cpu", "dequant"):
        layer = FusedMoE(e, h, i)
        layer.attach(Int4MoEMethod(scheme, True, backend))
        for x in range(e):
            for shard, t in (("w1", w13[x, :i]), ("w3", w13[x, i:]), ("w2", w2[x])):
                layer.method.load(layer, x, shard, t)
        layer.method.process_after_loading(layer)
        layers[backend] = layer
    twin = layers["dequant"]  # the loading layout (the cpu layer's codes are in panels now)
    dq13 = torch.stack([twin.method.dequantized(twin, "w13", x, torch.float32) for x in range(e)])
    dq2 = torch.stack([twin.method.dequantized(twin, "w2", x, torch.float32) for x in range(e)])
    fused = cpu_linear.gate_up_fusable(i)
    p13, p2 = cpu_moe.pack_experts(dq13, dq2, fused)
    x = torch.randn(num_tokens, h, generator=gen)
    weights, ids = softmax_topk(torch.randn(num_tokens, e, generator=gen), k, renormalize=True)
    fns = {
        "c-int4": lambda: layers["cpu"](x, weights, ids),
        "c-float32": lambda: cpu_moe.fused_moe(x, p13, p2, weights, ids, i, fused),
        "torch-dequant": lambda: layers["dequant"](x, weights, ids),
    }
    want = reference.fused_moe(x, dq13, dq2, weights, ids)
    for name, fn in fns.items():
        torch.testing.assert_close(fn(), want, rtol=1e-4, atol=1e-4, msg=lambda msg, n=name: f"{n}: {msg}")
    cpu = layers["cpu"]
    held = sum(getattr(cpu, n).numel() * getattr(cpu, n).element_size()
               for n in ("w13", "w13_scale", "w13_offset", "w2", "w2_scale", "w2_offset"))
    return fns, {"c-int4": held, "c-float32": 4 * (p13.numel() + p2.numel())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {cpu_model()} ({isa()}), torch threads {torch.get_num_threads()}, layer {LAYER}")
    print("| tokens | c-int4 | c-float32 | torch-dequant | c-float32 / c-int4 | torch-dequant / c-int4 |")
    print("|---:|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for n in TOKENS:
            fns, nbytes = peers(n)
            runs: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    runs[name].append(time_calls(fn)[0] * 1e3)
            med = {name: statistics.median(v) for name, v in runs.items()}
            print(f"| {n} | {med['c-int4']:.2f} | {med['c-float32']:.2f} | {med['torch-dequant']:.2f} | "
                  f"{med['c-float32'] / med['c-int4']:.2f}x | {med['torch-dequant'] / med['c-int4']:.2f}x |", flush=True)
    print(f"# expert bytes held: int4 {nbytes['c-int4'] / 2**20:.1f} MiB (codes, float32 scales and offsets), float32 "
          f"panels {nbytes['c-float32'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
