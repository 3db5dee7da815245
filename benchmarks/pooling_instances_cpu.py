"""One pooling instance with every CPU thread vs several single-threaded instances, in one
process, no HTTP: what `stoker serve --instance-count` chooses between (pooling/instances.py).

The model and inputs are benchmarks/embeddings_cpu.py's (a MiniLM-shaped random BERT embedder,
passages of 8-40 words or queries of 3-10 words, tokenized up front). Each configuration embeds
the same `--inputs` inputs in batches of `b`:

  1 x T, bB   one instance (the calling thread) with T torch threads, batches of B
  N x 1, bB   N instances (instance_executor: N worker threads of 1 thread each), the inputs
              dealt round-robin, each instance running its share in batches of B

All configurations alternate within each of `--rounds` rounds; medians of inputs/s. The process
sets OMP_WAIT_POLICY=PASSIVE, as `stoker serve` does.

    .venv/bin/python benchmarks/pooling_instances_cpu.py [--rounds 3] [--inputs 1024]
                                                          [--workload passages|queries]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as stoker/cpu_runtime.py does
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.embeddings_cpu import MINILM, WORKLOADS, make_inputs  # noqa: E402
from benchmarks.machine import cpu_model, isa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="passages")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from stoker.pooling.instances import instance_executor
    from stoker.pooling.runner import PoolingRunner, PoolInput
    from stoker.testing.tiny_pooling import make_bert_embedder

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "minilm", **MINILM)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        items = [PoolInput(tok(t)["input_ids"]) for t in make_inputs(args.inputs, words=WORKLOADS[args.workload])]
        runner = PoolingRunner.from_folder(model_dir, device="cpu")

    def run_share(share: list[PoolInput], batch: int) -> None:
        for i in range(0, len(share), batch):
            runner.run(share[i:i + batch])

    def one_instance(batch: int) -> float:
        t0 = time.perf_counter()
        run_share(items, batch)
        return len(items) / (time.perf_counter() - t0)

    pool = instance_executor(2, 1)

    def instances(n: int, batch: int) -> float:  # n <= the pool's 2 instances
        t0 = time.perf_counter()
        for f in [pool.submit(run_share, items[j::n], batch) for j in range(n)]:
            f.result()
        return len(items) / (time.perf_counter() - t0)

    configs = {f"1 x {threads}, b32": lambda: one_instance(32), f"1 x {threads}, b16": lambda: one_instance(16),
               "2 x 1, b16": lambda: instances(2, 16), "2 x 1, b8": lambda: instances(2, 8)}
    for fn in configs.values():  # warm-up: every thread's first forward
        fn()
    results: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for name, fn in configs.items():
            results[name].append(fn())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}/s" for k, v in results.items()), flush=True)
    print(f"\n{args.workload}, {args.inputs} inputs; CPU: {cpu_model()} ({isa()}), {os.cpu_count()} CPUs, torch threads "
          f"{threads}; medians of {args.rounds} rounds; load average {os.getloadavg()[0]:.2f}\n")
    print("| instances x threads, batch | inputs/s |")
    print("|---|---:|")
    for name, v in results.items():
        print(f"| {name} | {statistics.median(v):.1f} |")
    pool.shutdown()


if __name__ == "__main__":
    main()
