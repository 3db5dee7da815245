"""Embedding throughput: `stoker serve` with the dynamic batcher on and off, against
sentence-transformers' `encode` at its best batch size, same inputs, same run.

Model: a MiniLM-L6-shaped random BERT (all-MiniLM-L6-v2's shape: hidden 384, 6 layers,
12 heads, intermediate 1536, mean pooling, normalized) in the sentence-transformers layout,
built by stoker/testing/tiny_pooling.py (its WordPiece vocabulary is small; the compute per
token is MiniLM's). Two workloads (`--workload`, default both): `passages`, `--inputs`
sentences of 8-40 words (documents being indexed), and `queries`, `--inputs` search queries of
3-10 words (what a retrieval service embeds at high rates, one per user query); random, seeded.
Server: `python -m stoker serve DIR` in a subprocess on 127.0.0.1; batcher on =
`--max-batch-size 32 --max-queue-delay-microseconds 2000`, off = `--max-batch-size 1`, each
with `--instance-count N` for every N of `--instance-counts` (default 2, the CPU default, and 1). The
client (aiohttp, this process) sends one input per /v1/embeddings request, `c` at a time,
asking for `--encoding-format` (base64 by default, as the official `openai` client does).
sentence-transformers runs in this process with the server idle, batch sizes 1..128, the
best kept. Throughput = inputs / wall seconds; each figure is the median of `--runs`.

    .venv/bin/python benchmarks/embeddings_cpu.py [--runs 3] [--inputs 512] [--levels 1 8 32 128]
                                                  [--max-queue-delay-microseconds 2000]
                                                  [--workload passages|queries|both]
                                                  [--instance-counts 2 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import cpu_model, isa  # noqa: E402

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              max_position_embeddings=512)


# workload -> (fewest, most) words per input
WORKLOADS = {"passages": (8, 40), "queries": (3, 10)}


def make_inputs(n: int, seed: int = 0, words: tuple[int, int] = WORKLOADS["passages"]) -> list[str]:
    from stoker.testing.tiny_pooling import _WORDS

    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stoker.cli", "serve", str(model_dir), "--port", str(port), "--served-model-name", "m",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


async def _load(url: str, inputs: list[str], concurrency: int, encoding_format: str = "base64") -> float:
    import aiohttp

    queue = list(enumerate(inputs))
    async with aiohttp.ClientSession() as session:
        async def worker() -> None:
            while queue:
                _, text = queue.pop()
                body = {"model": "m", "input": text, "encoding_format": encoding_format}
                async with session.post(url + "/v1/embeddings", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(inputs) / (time.perf_counter() - t0)


def st_best(model_dir: Path, inputs: list[str]) -> tuple[float, int]:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(str(model_dir), device="cpu")
    st.encode(inputs[:64], batch_size=32)  # warm-up
    best = (0.0, 0)
    for bs in (1, 8, 32, 64, 128):
        t0 = time.perf_counter()
        st.encode(inputs, batch_size=bs)
        rate = len(inputs) / (time.perf_counter() - t0)
        best = max(best, (rate, bs))
    return best


def run_workload(model_dir: Path, workload: str, args: argparse.Namespace, levels: list[int],
                 configs: dict[str, list[str]]) -> None:
    """Every run: sentence-transformers, then the server with each config; then the table."""
    inputs = make_inputs(args.inputs, words=WORKLOADS[workload])
    results: dict[str, dict[int, list[float]]] = {k: {c: [] for c in levels} for k in configs}
    st_runs: list[tuple[float, int]] = []
    for run in range(args.runs):
        st_runs.append(st_best(model_dir, inputs))
        for name, flags in configs.items():
            proc, url = start_server(model_dir, flags)
            try:
                asyncio.run(_load(url, inputs[:64], 8, args.encoding_format))  # warm-up
                for c in levels:
                    n = inputs if c > 1 or name.startswith("on") else inputs[: len(inputs) // 2]
                    results[name][c].append(asyncio.run(_load(url, n, c, args.encoding_format)))
            finally:
                proc.terminate()
                proc.wait(30)
        print(f"{workload} run {run + 1}: st {st_runs[-1][0]:.1f}/s (batch {st_runs[-1][1]}), "
              + ", ".join(f"{k} c{c} {v[c][-1]:.1f}/s" for k, v in results.items() for c in levels), flush=True)
    st_rate = statistics.median(r for r, _ in st_runs)
    lo, hi = WORKLOADS[workload]
    print(f"\n{workload}: {args.inputs} inputs of {lo}-{hi} words; CPU: {cpu_model()} ({isa()}), {os.cpu_count()} CPUs; "
          f"medians of {args.runs} runs; load average {os.getloadavg()[0]:.2f}")
    print(f"sentence-transformers encode, best batch size: {st_rate:.1f} inputs/s "
          f"(runs {[round(r, 1) for r, _ in st_runs]}, batch sizes chosen: {[b for _, b in st_runs]})\n")
    med = {k: {c: statistics.median(v[c]) for c in levels} for k, v in results.items()}
    counts = sorted({int(k.split()[-2]) for k in configs}, reverse=True)
    head = " | ".join(f"on, {n} inst. | off, {n} inst. | on / off ({n})" for n in counts)
    print(f"| concurrency | {head} | on ({counts[0]} inst.) / sentence-transformers best |")
    print("|---:|" + "---:|---:|---:|" * len(counts) + "---:|")
    for c in levels:
        cells = " | ".join(f"{med[f'on, {n} inst.'][c]:.1f} | {med[f'off, {n} inst.'][c]:.1f} | "
                           f"{med[f'on, {n} inst.'][c] / med[f'off, {n} inst.'][c]:.2f}x" for n in counts)
        print(f"| {c} | {cells} | {100 * med[f'on, {counts[0]} inst.'][c] / st_rate:.0f}% |")
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=512)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 128], help="concurrency levels (default: 1 8 32 128)")
    ap.add_argument("--max-queue-delay-microseconds", type=int, default=2000,
                    help="the batcher-on configs' delay (default 2000; Triton's own default is 0)")
    # The official `openai` client asks for base64 unless told otherwise (openai/lib/_parsing/
    # _embeddings.py: encoding_format defaults to "base64" when not given); float is JSON numbers.
    ap.add_argument("--encoding-format", choices=["base64", "float"], default="base64",
                    help="what each request asks for (default: what the openai client sends)")
    ap.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both",
                    help="passages (8-40 words), queries (3-10 words) or both, one after the other (default)")
    ap.add_argument("--instance-counts", type=int, nargs="+", default=[2, 1],
                    help="server instance counts to run, batcher on and off each (default: 2 1)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stoker.testing.tiny_pooling import make_bert_embedder

    levels = args.levels
    configs: dict[str, list[str]] = {}
    for n in args.instance_counts:  # Triton's instance_group count (stoker serve's default on CPU: 2)
        configs[f"on, {n} inst."] = ["--max-batch-size", "32", "--max-queue-delay-microseconds", str(args.max_queue_delay_microseconds),
                                     "--instance-count", str(n)]
        configs[f"off, {n} inst."] = ["--max-batch-size", "1", "--instance-count", str(n)]
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "minilm", **MINILM)
        for workload in workloads:
            run_workload(model_dir, workload, args, levels, configs)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
