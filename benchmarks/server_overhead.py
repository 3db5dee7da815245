"""What does the HTTP server cost? The engine benchmark's workload, offline vs through `stoker serve`.

Workload (the engine-core benchmark's): a Llama-shaped random model (hidden 512, intermediate
1408, 8 layers, 8 heads / 4 KV heads, vocab 1024 = the bundled tokenizer), float32 on CPU;
64 requests, prompt lengths uniform in [32, 256], output lengths uniform in [16, 128],
ignore_eos, greedy. Offline: one `LLM.generate` call. Server: `python -m stoker serve` in a
subprocess on 127.0.0.1, all 64 requests sent at once as streamed /v1/completions (token-id
prompts, so both sides run exactly the same tokens) from an aiohttp client in this process;
output tokens are counted from usage.completion_tokens. Runs alternate offline / server so
machine drift hits both; the table gives every run and the medians.

    .venv/bin/python benchmarks/server_overhead.py [--runs 3] [--threads N] [--wait-policy server|libgomp]

OpenMP's wait policy is the same on both sides by default (`--wait-policy server`: the offline
side gets what `stoker serve` sets, OMP_WAIT_POLICY=PASSIVE unless the environment chose,
stoker/cpu_runtime.py), so the ratio measures the server, not the policy. `--wait-policy libgomp`
leaves the offline side on libgomp's own default (workers spin before sleeping), which is faster
on an idle machine and collapses beside a busy process (docs/benchmarks.md, "CPU serving under
contention"): the ratio then also holds that policy's cost.

On a small shared machine pin --threads: with every core given to torch, any other process
(here: the client, or a neighbour's job) stalls torch's OpenMP barriers and a run can slow
down ten-fold at random, which drowns the server-vs-offline difference being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024)
MAX_MODEL_LEN = 512


def workload(seed: int = 0, num: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Ids above the bundled tokenizer's special tokens, so every id is a plain text token.
    return [([rng.randrange(16, 1024) for _ in range(rng.randint(32, 256))], rng.randint(16, 128)) for _ in range(num)]


def run_offline(llm, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    from stoker import SamplingParams

    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


async def _one(session, url: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


async def _run_server_async(url: str, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await _one(session, url, reqs[0][0][:8], 2)  # a warm connection pool, not a timed request
        start = time.perf_counter()
        counts = await asyncio.gather(*(_one(session, url, p, o) for p, o in reqs))
        return time.perf_counter() - start, sum(counts)


def start_server(ckpt: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stoker", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--device", "cpu",
           "--served-model-name", "bench", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server not ready in 300 s")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads on both sides (OMP_NUM_THREADS for the server); default: torch's")
    ap.add_argument("--wait-policy", choices=["server", "libgomp"], default="server",
                    help="the offline side's OpenMP wait policy: the server's (default) or libgomp's own")
    ap.add_argument("--json", default=None, help="write the runs and medians here")
    args = ap.parse_args()
    if args.wait_policy == "server":
        from stoker.cpu_runtime import configure_openmp  # pure Python: torch not loaded yet

        configure_openmp()
    if args.threads:
        # Set before torch loads here, and inherited by the server process.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from stoker import LLM
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    # Removed at exit (weakref finalizer), also when a run fails: the checkpoint is ~95 MB.
    tmp_dir = tempfile.TemporaryDirectory(prefix="stoker-server-bench-")
    tmp = Path(tmp_dir.name)
    ckpt = make_tiny_checkpoint(tmp / "model", arch="llama", seed=0, **MODEL)
    reqs = workload(num=args.num_requests)
    llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)
    llm.generate({"prompt_token_ids": reqs[0][0][:8]}, use_tqdm=False)  # warm-up

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(ckpt, port, tmp / "server.log")
    url = f"http://127.0.0.1:{port}"
    offline, server = [], []
    try:
        for run in range(args.runs):
            # Fresh random prompts (same length distribution) per run: repeating the same ones
            # would let both engines serve them from their prefix caches after the first run.
            reqs = workload(seed=run + 1, num=args.num_requests)
            t, n = run_offline(llm, reqs)
            offline.append(n / t)
            print(f"run {run}: offline {n} tokens in {t:.2f} s = {n / t:.1f} tok/s (load avg {os.getloadavg()[0]:.1f})", flush=True)
            t, n = asyncio.run(_run_server_async(url, reqs))
            server.append(n / t)
            print(f"run {run}: server  {n} tokens in {t:.2f} s = {n / t:.1f} tok/s (load avg {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    off, srv = statistics.median(offline), statistics.median(server)
    print()
    policy = os.environ.get("OMP_WAIT_POLICY") or (f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}"
                                                    if os.environ.get("GOMP_SPINCOUNT") else "libgomp default")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, Python {platform.python_version()}; offline wait policy: {policy}")
    print("| | output tok/s (median) | runs |")
    print("|---|---:|---|")
    print(f"| offline LLM.generate | {off:.1f} | {', '.join(f'{x:.1f}' for x in offline)} |")
    print(f"| stoker serve, 64 streams at once | {srv:.1f} | {', '.join(f'{x:.1f}' for x in server)} |")
    print(f"| server / offline | {100 * srv / off:.1f}% | target >= 90% |")
    if args.json:
        Path(args.json).write_text(json.dumps({"offline_tokens_per_s": offline, "server_tokens_per_s": server,
                                               "offline_median": off, "server_median": srv, "server_over_offline": srv / off,
                                               "threads": torch.get_num_threads(), "wait_policy": policy}, indent=2))


if __name__ == "__main__":
    main()
