"""What a busy event loop costs the pooling instances: the GIL, or only the CPU? (issue 18)

Two instances (threads, one torch thread each, as `stoker serve` runs a pooling model on 2
CPUs) run batches of `--batch` queries back to back for `--seconds`, in one process, beside:

  * none: nothing else;
  * thread: a pure-Python thread of this process busy `--duty` of a core in 0.5 ms bursts
    (holding the GIL, as the server's event loop does: 0.25-0.3 of a core at c = 32);
  * process: the same bursts in another process (the CPU taken, no GIL shared).

The three alternate for `--rounds` rounds; medians of queries/s (both instances) and of the
instances' in-batch wall time over their CPU time (1.0: never off the CPU inside a batch).

    .venv/bin/python benchmarks/pooling_gil_cpu.py [--batch 9] [--duty 0.25] [--seconds 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `stoker` command sets it; before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.embeddings_cpu import MINILM, WORKLOADS, make_inputs  # noqa: E402
from benchmarks.machine import cpu_model, isa  # noqa: E402

BURST_S = 0.0005
BURSTS = """
import sys, time
burst, rest = float(sys.argv[1]), float(sys.argv[2])
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < burst:
        pass
    time.sleep(rest)
"""


def busy_python(stop: threading.Event, burst: float, rest: float) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < burst:  # pure Python: holds the GIL
            pass
        time.sleep(rest)


def one_round(runner, batches: list, mode: str, burst: float, rest: float, seconds: float) -> tuple[float, float]:
    import torch

    stop = threading.Event()
    stats: list[tuple[float, float, int]] = []  # (wall, cpu, size) per batch

    def instance(offset: int) -> None:
        torch.set_num_threads(1)
        i = offset
        while not stop.is_set():
            batch = batches[i % len(batches)]
            i += 2
            t0, c0 = time.monotonic(), time.thread_time()
            runner.run_rows(batch)
            stats.append((time.monotonic() - t0, time.thread_time() - c0, len(batch)))

    threads = [threading.Thread(target=instance, args=(k,)) for k in range(2)]
    if mode == "thread":
        threads.append(threading.Thread(target=busy_python, args=(stop, burst, rest)))
    other = subprocess.Popen([sys.executable, "-c", BURSTS, str(burst), str(rest)]) if mode == "process" else None
    try:
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
    finally:
        if other is not None:
            other.kill()
            other.wait()
    done = stats[4:]  # the first batches warm the instances up
    return sum(s for _, _, s in done) / wall, sum(w for w, _, _ in done) / sum(c for _, c, _ in done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=9, help="queries per batch (the server's mean at c = 32: 8-9)")
    ap.add_argument("--duty", type=float, default=0.25, help="fraction of a core the competing load keeps busy")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stoker.engine.tokenizer import load_tokenizer
    from stoker.pooling.runner import PoolingRunner, PoolInput
    from stoker.testing.tiny_pooling import make_bert_embedder

    burst, rest = BURST_S, BURST_S * (1 - args.duty) / args.duty
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "minilm", **MINILM)
        runner = PoolingRunner.from_folder(str(model_dir), "auto", "cpu", None)
        ids = load_tokenizer(str(model_dir))(make_inputs(512, words=WORKLOADS["queries"]))["input_ids"]
    batches = [[PoolInput(x) for x in ids[i:i + args.batch]] for i in range(0, len(ids) - args.batch, args.batch)]
    results: dict[str, list[tuple[float, float]]] = {"none": [], "thread": [], "process": []}
    for r in range(args.rounds):
        for mode in results:
            results[mode].append(one_round(runner, batches, mode, burst, rest, args.seconds))
            rate, ratio = results[mode][-1]
            print(f"round {r + 1}, {mode}: {rate:.1f} queries/s, in-batch wall/cpu {ratio:.2f}", flush=True)
    print(f"\n{cpu_model()} ({isa()}), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; 2 instances x 1 "
          f"thread, batches of {args.batch} queries; competing load {args.duty:.0%} of a core in {1e3 * burst:.1f} ms "
          f"bursts; medians of {args.rounds} rounds")
    print("| beside the instances | queries/s | vs none | in-batch wall / cpu |\n|---|---:|---:|---:|")
    base = statistics.median(r for r, _ in results["none"])
    for mode, rows in results.items():
        rate = statistics.median(r for r, _ in rows)
        print(f"| {mode} | {rate:.1f} | {rate / base:.2f}x | {statistics.median(w for _, w in rows):.2f} |")


if __name__ == "__main__":
    main()
