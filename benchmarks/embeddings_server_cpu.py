"""Where the embedding server's CPU goes under load: the server's cores (from /proc), the load
client's, and throughput with torch's default threads vs one, alternated (issue 18).

    .venv/bin/python benchmarks/embeddings_server_cpu.py [--requests 2000] [--rounds 2]

The server and model are benchmarks/embeddings_cpu.py's (a MiniLM-shaped random embedder, batcher
on: --max-batch-size 32 --max-queue-delay-microseconds 2000, access log off); passages, base64,
c = 32, one input per request. The server's CPU is user + system time of its process over the
timed load (/proc/PID/stat), the client's that of this process (resource.getrusage).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.embeddings_cpu import MINILM, WORKLOADS, _load, make_inputs, start_server  # noqa: E402
from benchmarks.machine import cpu_model, isa  # noqa: E402

BATCHER = ["--max-batch-size", "32", "--max-queue-delay-microseconds", "2000"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def client_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_run(model_dir: Path, inputs: list[str], threads: int) -> dict[str, float]:
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by torch in the server process at start-up
    proc, url = start_server(model_dir, BATCHER)
    try:
        asyncio.run(_load(url, inputs[:256], 32))  # warm-up
        server0, client0, t0 = cpu_seconds(proc.pid), client_seconds(), time.perf_counter()
        rate = asyncio.run(_load(url, inputs, 32))
        wall = time.perf_counter() - t0
        return {"rate": rate, "server_cores": (cpu_seconds(proc.pid) - server0) / wall,
                "client_cores": (client_seconds() - client0) / wall}
    finally:
        proc.terminate()
        proc.wait(30)
        os.environ.pop("OMP_NUM_THREADS", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stoker.testing.tiny_pooling import make_bert_embedder

    inputs = make_inputs(args.requests, words=WORKLOADS["passages"])
    runs: dict[int, list[dict[str, float]]] = {2: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "minilm", **MINILM)
        for r in range(args.rounds):
            for threads in runs:
                runs[threads].append(one_run(model_dir, inputs, threads))
                x = runs[threads][-1]
                print(f"round {r + 1}, {threads} thread(s): {x['rate']:.1f} inputs/s, server {x['server_cores']:.2f} "
                      f"cores, client {x['client_cores']:.2f} cores", flush=True)
    print(f"\n{cpu_model()} ({isa()}), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.requests} passages at c = 32, base64; medians of {args.rounds} rounds")
    for threads, xs in runs.items():
        med = {k: statistics.median(x[k] for x in xs) for k in xs[0]}
        print(f"{threads} thread(s): {med['rate']:.1f} inputs/s, server {med['server_cores']:.2f} cores, "
              f"client {med['client_cores']:.2f} cores")


if __name__ == "__main__":
    main()
