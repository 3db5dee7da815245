"""Where the embedding server's CPU goes under load, thread by thread (issue 18).

    .venv/bin/python benchmarks/embeddings_server_cpu.py [--workload queries|passages]
                                                         [--requests 4000] [--rounds 2]

The server and model are benchmarks/embeddings_cpu.py's (a MiniLM-shaped random embedder,
batcher on: --max-batch-size 32 --max-queue-delay-microseconds 2000, the default instance
count, access log off); c = 32, one input per request, base64. For each round, over the timed
load: every server thread's CPU (user + system, /proc/PID/task/TID/stat) per request, the
event loop being the main thread and the rest ranked by CPU (the instances first, then the
tokenizer thread), and the share of the wall time the busiest instance thread was runnable but
waiting for a CPU (schedstat); the load client's CPU (this process, resource.getrusage); the whole
machine's idle cores (/proc/stat); and the server's batches (its /metrics). A server that
uses less than the machine's cores while requests wait is waiting on something other than
CPU (docs/benchmarks.md, "Embeddings on CPU").
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
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.embeddings_cpu import MINILM, WORKLOADS, _load, make_inputs, start_server  # noqa: E402
from benchmarks.machine import cpu_model, isa  # noqa: E402

BATCHER = ["--max-batch-size", "32", "--max-queue-delay-microseconds", "2000"]
TICK = os.sysconf("SC_CLK_TCK")


def thread_seconds(pid: int) -> dict[int, tuple[float, float]]:
    """(CPU seconds (user + system), seconds runnable but waiting for a CPU) of each thread of
    `pid`, by thread id (/proc/PID/task/TID/stat and schedstat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            waited_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except OSError:  # the thread ended
            continue
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / TICK, waited_ns / 1e9)
    return out


def machine_ticks() -> tuple[int, int]:
    """(idle, total) jiffies over every CPU, from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return values[3] + values[4], sum(values)  # idle + iowait


def client_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def batch_sums(url: str) -> tuple[float, float]:
    """(batches, items) the server has run so far, from stoker:pooling_batch_size."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("stoker:pooling_batch_size_")}
    return values.get("stoker:pooling_batch_size_count", 0.0), values.get("stoker:pooling_batch_size_sum", 0.0)


def one_round(url: str, pid: int, inputs: list[str]) -> dict[str, float]:
    threads0, client0, (idle0, total0), batches0 = thread_seconds(pid), client_seconds(), machine_ticks(), batch_sums(url)
    t0 = time.perf_counter()
    rate = asyncio.run(_load(url, inputs, 32))
    wall = time.perf_counter() - t0
    threads1, client1, (idle1, total1), batches1 = thread_seconds(pid), client_seconds(), machine_ticks(), batch_sums(url)
    n = len(inputs)
    used = {tid: (threads1[tid][0] - threads0.get(tid, (0.0, 0.0))[0], threads1[tid][1] - threads0.get(tid, (0.0, 0.0))[1])
            for tid in threads1}
    loop = used.pop(pid, (0.0, 0.0))[0]
    ranked_threads = sorted(used.values(), reverse=True)  # by CPU: the instances first
    ranked = [cpu for cpu, _ in ranked_threads]
    row = {"rate": rate, "event loop": 1e6 * loop / n}
    for i, seconds in enumerate(ranked[:3]):
        row[f"thread {i + 1}"] = 1e6 * seconds / n
    row["thread 1 runq wait"] = ranked_threads[0][1] / wall if ranked_threads else 0.0  # fraction of the wall time
    row["other threads"] = 1e6 * sum(ranked[3:]) / n
    row["server"] = 1e6 * (loop + sum(ranked)) / n
    row["client"] = 1e6 * (client1 - client0) / n
    row["server cores"] = (loop + sum(ranked)) / wall
    row["idle cores"] = (os.cpu_count() or 1) * (idle1 - idle0) / max(1, total1 - total0)
    row["mean batch"] = (batches1[1] - batches0[1]) / max(1.0, batches1[0] - batches0[0])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="queries")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--instance-count", type=int, default=None, help="the server's (default: its own, by device)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stoker.testing.tiny_pooling import make_bert_embedder

    inputs = make_inputs(args.requests, words=WORKLOADS[args.workload])
    flags = BATCHER + ([] if args.instance_count is None else ["--instance-count", str(args.instance_count)])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "minilm", **MINILM)
        proc, url = start_server(model_dir, flags)
        try:
            asyncio.run(_load(url, inputs[:256], 32))  # warm-up
            for r in range(args.rounds):
                rows.append(one_round(url, proc.pid, inputs))
                print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" if "cores" in k or "wait" in k else f"{k} {v:.1f}"
                                                     for k, v in rows[-1].items()), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\n{cpu_model()} ({isa()}), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.requests} "
          f"{args.workload} at c = 32, base64; medians of {args.rounds} rounds; CPU in us per request")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---:|" * len(rows[0]))
    print("| " + " | ".join(f"{statistics.median(r[k] for r in rows):.2f}" if "cores" in k or "wait" in k else
                            f"{statistics.median(r[k] for r in rows):.1f}" for k in rows[0]) + " |")


if __name__ == "__main__":
    main()
