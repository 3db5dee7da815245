"""MBU of the Triton fused-MoE kernel on a Mixtral-8x7B-shaped layer (H 4096, I 14336, E 8, top-2).

    python benchmarks/moe_gpu.py                          # bf16 experts, batch 1 and 128, needs a GPU
    python benchmarks/moe_gpu.py --weights fp8 int8       # 8-bit experts (per-channel scales) too
    python benchmarks/moe_gpu.py --batch 1 8 128 --json moe.json
    python benchmarks/moe_gpu.py --graph                  # the Triton rows as CUDA-graph replays (as decode runs)
    python benchmarks/moe_gpu.py --smoke                  # tiny shapes on CPU via the interpreter:
                                                          # exercises this script, times nothing useful

Each row: the median time of one layer call (routing given), the bytes it must read (the
weights of the experts the routing touches, their scales, x, and the output written) and
MBU = bytes / time / peak HBM bandwidth, the peak from stoker/roofline/hardware.py for the
device torch names (`--peak-gb-s` overrides it; a device missing from the table needs it).
Impls: "triton fused_moe" is the tiled path (tl.dot over BLOCK_M pairs of one expert),
forced; "triton fused_moe small-batch" the GEMV-style path fused_moe picks for T <=
SMALL_BATCH_TOKENS, forced, timed up to 16 pairs (above that it re-reads an expert's weights per
pair);
the peer is the per-expert torch loop the other methods run (layers/moe.expert_by_expert:
cuBLAS GEMMs, weights dequantized in torch for 8-bit). Before timing, the small-batch output is
checked against the twin (reference.fused_moe_grouped): its relative error is printed. Routing:
softmax top-2 of random logits (seeded), so batch 128 touches all 8 experts and batch 1 two.
Without CUDA (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from stoker.kernels import reference  # noqa: E402
from stoker.layers.moe import expert_by_expert  # noqa: E402
from stoker.layers.moe_router import softmax_topk  # noqa: E402
from stoker.quantization import formats  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
SMALL_TIMED_PAIRS = 16  # the small-batch row up to this many pairs: its crossover with the tiled path


@dataclass
class Row:
    weights: str
    batch: int
    impl: str
    experts_touched: int
    ms: float
    graph: bool  # timed as CUDA-graph replays
    gb: float  # bytes that must move, in 1e9
    gb_per_s: float
    mbu: float  # gb_per_s / peak


def bench(fn: Callable[[], object], device: torch.device, graph: bool = False) -> float:
    """Median milliseconds per call; graph: of a CUDA graph holding the call, replayed."""
    if device.type == "cuda":
        import triton.testing

        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()  # smoke mode: one warm call, one timed call
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def peak_gb_per_s(device: torch.device, override: float | None) -> tuple[float, str]:
    if override:
        return override, "--peak-gb-s"
    if device.type != "cuda":
        return 3350.0, "H100-SXM (smoke: a stand-in, nothing is timed)"
    from stoker.roofline.hardware import gpu_from_device_name

    name = torch.cuda.get_device_name(device)
    spec = gpu_from_device_name(name)
    if spec is None:
        sys.exit(f"{name!r} is not in stoker/roofline/hardware.py's table: pass its HBM bandwidth as --peak-gb-s")
    return spec.hbm_gb_per_s, f"{spec.name} ({name})"


def experts(kind: str, dtype: torch.dtype, device: torch.device, hidden: int, inter: int, num_experts: int):
    """w13 (E, 2I, H), w2 (E, H, I) in `dtype`, or int8/FP8 with per-channel scales (E, N, 1)."""
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device, dtype=dtype) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device, dtype=dtype) / inter**0.5
    if kind == "bf16":
        return w13, w2, None, None
    quantized = []
    for w in (w13, w2):
        scale = (w.float().abs().amax(dim=2, keepdim=True) / (formats.FP8_MAX if kind == "fp8" else formats.INT8_MAX))
        quantized.append((formats.quantize_with(w, scale, kind), scale))
    (q13, s13), (q2, s2) = quantized
    return q13, q2, s13, s2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 128])
    parser.add_argument("--weights", nargs="+", default=["bf16"], choices=["bf16", "fp8", "int8"])
    parser.add_argument("--peak-gb-s", type=float, default=None, help="HBM bandwidth to divide by (default: the table's)")
    parser.add_argument("--no-peer", action="store_true", help="skip the per-expert torch loop")
    parser.add_argument("--graph", action="store_true", help="time the Triton impls as CUDA-graph replays")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks/moe_gpu.py needs a CUDA GPU (none is visible to torch); nothing was measured. "
              "--smoke runs the script on CPU through the Triton interpreter.")
        return 0
    device = torch.device("cuda" if not args.smoke else "cpu")
    hidden, inter, num_experts = (HIDDEN, INTER, EXPERTS) if not args.smoke else (64, 96, EXPERTS)
    dtype = torch.bfloat16
    peak, peak_source = peak_gb_per_s(device, args.peak_gb_s)

    from stoker.kernels.fused_moe import fused_moe

    rows: list[Row] = []
    for kind in args.weights:
        w13, w2, s13, s2 = experts(kind, dtype, device, hidden, inter, num_experts)
        per_expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        if s13 is not None:
            per_expert_bytes += (s13[0].numel() + s2[0].numel()) * 4
        for batch in args.batch:
            gen = torch.Generator(device=device).manual_seed(batch)
            x = torch.randn(batch, hidden, generator=gen, device=device, dtype=dtype)
            logits = torch.randn(batch, num_experts, generator=gen, device=device)
            weights, ids = softmax_topk(logits, TOP_K, renormalize=True)
            touched = int(ids.unique().numel())  # read once, outside the timing
            moved = touched * per_expert_bytes + 2 * x.numel() * x.element_size()  # weights + x in + out
            gk = (hidden, inter) if s13 is not None else (None, None)
            impls: dict[str, Callable[[], object]] = {
                "triton fused_moe": lambda: fused_moe(x, w13, w2, weights, ids, "silu", s13, s2, *gk, small_batch=False)}
            if batch * TOP_K <= SMALL_TIMED_PAIRS:
                small = lambda: fused_moe(x, w13, w2, weights, ids, "silu", s13, s2, *gk, small_batch=True)  # noqa: E731
                impls["triton fused_moe small-batch"] = small
                twin = reference.fused_moe_grouped(x, w13, w2, weights, ids, "silu", s13, s2, *gk).float()
                err = float((small().float() - twin).norm() / twin.norm())
                print(f"check {kind} batch {batch}: small-batch vs twin relative error {err:.2e}")
            if not args.no_peer:
                if s13 is None:
                    fwd = lambda e, r: reference.silu_and_mul(r @ w13[e].t()) @ w2[e].t()  # noqa: E731
                else:
                    fwd = lambda e, r: reference.w8_linear(  # noqa: E731
                        reference.silu_and_mul(reference.w8_linear(r, w13[e], s13[e], hidden)), w2[e], s2[e], inter)
                impls["torch per-expert loop"] = lambda: expert_by_expert(x, weights, ids, num_experts, fwd)
            for impl, fn in impls.items():
                graph = args.graph and impl.startswith("triton")  # the loop reads the routing on the host
                ms = bench(fn, device, graph)
                gb_per_s = moved / (ms * 1e-3) / 1e9
                rows.append(Row(kind, batch, impl, touched, ms, graph, moved / 1e9, gb_per_s, gb_per_s / peak))
        del w13, w2, s13, s2
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"Mixtral-8x7B-shaped MoE layer: H {hidden}, I {inter}, E {num_experts}, top-{TOP_K}; x bf16; "
          f"peak {peak:.0f} GB/s from {peak_source}")
    print(f"{'weights':8} {'batch':>5} {'impl':29} {'experts':>7} {'ms':>9} {'graph':>5} {'GB':>7} {'GB/s':>8} {'MBU':>6}")
    for r in rows:
        print(f"{r.weights:8} {r.batch:5d} {r.impl:29} {r.experts_touched:7d} {r.ms:9.3f} {'yes' if r.graph else 'no':>5} "
              f"{r.gb:7.3f} {r.gb_per_s:8.0f} {r.mbu:6.1%}")
    if args.smoke:
        print("(smoke: interpreted on CPU, the times mean nothing)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gb_per_s": peak, "peak_source": peak_source, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
