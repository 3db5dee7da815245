"""One encoder layer's attention over a batch of 32 packed sequences: the C kernel over the
packed tokens (no padding) vs SDPA on the padded batch, alternated in one process (issue 18).

    .venv/bin/python benchmarks/varlen_attention_cpu.py [--rounds 5] [--calls 50]

Shapes: MiniLM's attention (12 heads of 32), 32 sequences of 10-45 tokens (passages) or 5-14
(queries), lengths seeded; torch's default threads. The batch layout is built once per path, as
a forward builds it once for all its layers. Each figure: the median over rounds of the mean of
`--calls` calls.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.machine import cpu_model, isa  # noqa: E402
from stoker.pooling.attention import VarlenAttention, VarlenBatch, varlen_attention_qkv, varlen_batch  # noqa: E402

SHAPES = {"passages": (10, 45), "queries": (5, 14)}
HEADS, HEAD_DIM = 12, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    scale = HEAD_DIM**-0.5
    print(f"{cpu_model()} ({isa()}), torch threads {torch.get_num_threads()}")
    print("| workload | tokens | padded SDPA (ms) | C kernel, packed (ms) | SDPA / kernel |")
    print("|---|---:|---:|---:|---:|")
    for name, (lo, hi) in SHAPES.items():
        rng = random.Random(0)
        lengths = [rng.randint(lo, hi) for _ in range(32)]
        qkv = torch.randn(sum(lengths), 3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
        layer = VarlenAttention(HEADS, HEADS, HEAD_DIM, scale, causal=False)

        # one layout per path, built once as a forward does (its tables are shared by the layers)
        kernel_batch, sdpa_batch = (VarlenBatch.build(lengths, torch.device("cpu")) for _ in range(2))

        def kernel() -> None:
            with varlen_batch(kernel_batch):
                layer.forward_qkv(qkv)

        def sdpa() -> None:
            varlen_attention_qkv(qkv, sdpa_batch, scale)

        times: dict[str, list[float]] = {"sdpa": [], "kernel": []}
        for _ in range(args.rounds):
            for label, fn in (("sdpa", sdpa), ("kernel", kernel)):
                for _ in range(3):
                    fn()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[label].append((time.perf_counter() - start) / args.calls * 1e3)
        assert layer.use_kernel, "the C kernels are not available here: nothing to compare"
        s, k = statistics.median(times["sdpa"]), statistics.median(times["kernel"])
        print(f"| {name} | {sum(lengths)} | {s:.2f} | {k:.2f} | {s / k:.2f}x |")


if __name__ == "__main__":
    main()
