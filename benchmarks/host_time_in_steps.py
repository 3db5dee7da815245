"""How much of a decode step is outside the C kernels: the real model (issue 2's shape) against
the near-empty probe that the CPU prediction uses for host overhead (issue 16's diagnosis).

    .venv/bin/python benchmarks/host_time_in_steps.py [--threads 1] [--iters 15]

Every function of the C library is wrapped to sum its time; a decode step (`ModelRunner.execute`
on a hand-built message, doctor/step_timing.py) is timed whole, and what is not C-kernel time is
the host's (Python, torch dispatch, allocations, sampling). Both models run the same layers and
ops, so the same calls; the difference is what cold caches do to the same host work. Medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.machine import cpu_model, isa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from stoker.doctor import onmachine, step_timing
    from stoker.kernels.cpu import build

    lib = build.library()
    if lib is None:
        sys.exit("the C kernels are not available here")
    spent = [0.0]
    for name in [n for n in dir(lib) if n.startswith("stoker_") and callable(getattr(lib, n))]:
        fn = getattr(lib, name)

        def timed(*a, fn=fn):
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(lib, name, timed)
    print(f"{cpu_model()} ({isa()}), {args.threads} thread(s), decode at context {args.context}")
    print("| model | B | step ms | C kernels ms | outside the kernels ms |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        real, probe = onmachine.build_checkpoints(Path(tmp))
        for label, path in (("issue 2 (95 MB)", real), ("probe (1.3 MB)", probe)):
            llm = onmachine.build_llm(path, [onmachine.Point("decode", 4, args.context)])
            runner = llm.engine.executor.driver_runner
            for batch in (1, 4):
                msg = step_timing.decode_message(batch, args.context, runner.block_size)
                for _ in range(3):
                    runner.execute(msg)
                total, kernels = [], []
                for _ in range(args.iters):
                    spent[0] = 0.0
                    start = time.perf_counter()
                    runner.execute(msg)
                    total.append(time.perf_counter() - start)
                    kernels.append(spent[0])
                t, k = statistics.median(total) * 1e3, statistics.median(kernels) * 1e3
                print(f"| {label} | {batch} | {t:.2f} | {k:.2f} | {t - k:.2f} |", flush=True)


if __name__ == "__main__":
    main()
