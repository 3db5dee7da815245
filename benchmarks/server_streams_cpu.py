"""Host time of the server at high concurrency: many streamed completions at once on a model so
small that the model step is cheap, as a GPU step is next to the host's per-token work.

Workload: a tiny random Llama (stoker.testing.tiny_checkpoint: hidden 64, 2 layers, the bundled
1024-token tokenizer), float32 on CPU; --num-requests streamed /v1/completions sent at once
(token-id prompts of --prompt-len tokens, --max-tokens output tokens each, ignore_eos, greedy),
--max-num-seqs as large, so every request decodes in the same batch. Offline: one LLM.generate
call on the same engine settings and prompts. Runs alternate offline / server; medians.

The client is a minimal raw-socket one (one connection per request, HTTP/1.1, the body read
until the [DONE] event, completion_tokens read from the usage chunk), so the load generator
takes as little of the shared CPU as it can. Each server run also reports the server's CPU time
per output token by thread (/proc: the event loop = the main thread, the engine = the busiest
other thread), user and system apart: less noisy than tok/s on a shared machine.

    .venv/bin/python benchmarks/server_streams_cpu.py [--runs 3] [--num-requests 256] [--max-tokens 64]
    .venv/bin/python benchmarks/server_streams_cpu.py --profile prof.txt   # cProfile of the server's two threads
    .venv/bin/python benchmarks/server_streams_cpu.py --smoke               # tiny dry run

--profile runs the server in-process-profiled (one cProfile for the event loop thread, one for
the engine thread) and writes both top-N tables; profiled throughput is not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_USAGE = re.compile(rb'"completion_tokens":(\d+)')


def workload(seed: int, num: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids above the bundled tokenizer's special tokens: every id is a plain text token.
    return [[rng.randrange(16, 1024) for _ in range(prompt_len)] for _ in range(num)]


async def _one(port: int, prompt: list[int], max_tokens: int) -> tuple[int, int]:
    """(completion tokens from the usage chunk, content events received)."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    chunks = []
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        chunks.append(data)
    writer.close()
    raw = b"".join(chunks)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    assert b"data: [DONE]" in raw, raw[-300:]
    m = _USAGE.findall(raw)
    return (int(m[-1]) if m else 0), raw.count(b'"text":')


async def run_server_load(port: int, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, int]:
    await _one(port, prompts[0][:4], 2)
    start = time.perf_counter()
    results = await asyncio.gather(*(_one(port, p, max_tokens) for p in prompts))
    return time.perf_counter() - start, sum(r[0] for r in results), sum(r[1] for r in results)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of process `pid`, user and system time apart (the event loop is
    the main thread), from /proc (Linux)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        user, system = int(fields[11]) / tick, int(fields[12]) / tick
        key = "event loop" if int(task.name) == pid else f"thread {task.name}"
        out[key + " user"] = user
        out[key + " system"] = system
    return out


def run_offline(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from stoker import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def serve_args(ckpt: Path, port: int, max_num_seqs: int, max_model_len: int) -> list[str]:
    return [str(ckpt), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--dtype", "float32", "--device", "cpu",
            "--served-model-name", "bench", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]


def start_server(args: list[str], log: Path, profile: Path | None) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--serve-profiled", str(profile), "--"] if profile else [sys.executable, "-m", "stoker", "serve"]
    proc = subprocess.Popen(cmd + args, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    port = args[args.index("--port") + 1]
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


def serve_profiled(out: Path, serve_argv: list[str]) -> None:
    """`stoker serve` with a cProfile on the event loop thread and one on the engine thread;
    both tables written to `out` at SIGTERM."""
    import cProfile
    import io
    import pstats
    import signal

    from stoker.engine.async_engine import AsyncEngine

    # CPU time, not wall time: a thread waiting for the GIL or preempted is not charged.
    engine_prof = cProfile.Profile(time.thread_time_ns, 1e-9)
    run = AsyncEngine._run

    def profiled_run(self: AsyncEngine) -> None:
        engine_prof.enable()
        try:
            run(self)
        finally:
            engine_prof.disable()

    AsyncEngine._run = profiled_run  # type: ignore[method-assign]
    loop_prof = cProfile.Profile(time.thread_time_ns, 1e-9)

    def dump(*_: object) -> None:
        loop_prof.disable()
        buf = io.StringIO()
        for name, prof in (("event loop thread", loop_prof), ("engine thread", engine_prof)):
            buf.write(f"==== {name}\n")
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
            by_package: dict[str, float] = {}
            for (file, _, func), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
                key = file.split("site-packages/")[-1].split("/")[0] if "site-packages" in file else (
                    "stoker/" + file.split("/stoker/")[-1] if "/stoker/" in file else (file if file != "~" else func))
                by_package[key] = by_package.get(key, 0.0) + tottime
            buf.write("tottime by package or file:\n")
            for key, t in sorted(by_package.items(), key=lambda kv: -kv[1])[:30]:
                buf.write(f"  {t:8.3f} s  {key}\n")
        out.write_text(buf.getvalue())
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    from stoker.cli import main as stoker_main

    sys.argv = ["stoker", "serve", *serve_argv]
    loop_prof.enable()
    stoker_main()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-profiled":
        serve_profiled(Path(sys.argv[2]), sys.argv[4:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides (OMP_NUM_THREADS)")
    ap.add_argument("--server-only", action="store_true", help="skip the offline runs")
    ap.add_argument("--profile", type=Path, default=None, help="profile the server; write the tables here")
    ap.add_argument("--smoke", action="store_true", help="tiny dry run: 8 requests of 8 tokens, one run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.num_requests, args.max_tokens = 1, 8, 8
    from stoker.cpu_runtime import configure_openmp

    configure_openmp()  # the server's OpenMP settings on the offline side too
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from stoker import LLM
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    max_model_len = args.prompt_len + args.max_tokens + 8
    tmp_dir = tempfile.TemporaryDirectory(prefix="stoker-streams-bench-")
    tmp = Path(tmp_dir.name)
    ckpt = make_tiny_checkpoint(tmp / "model", arch="llama", seed=0, max_position_embeddings=max(max_model_len, 256))
    llm = None
    if not args.server_only:
        llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=max_model_len, max_num_seqs=args.num_requests)
        run_offline(llm, workload(0, 2, args.prompt_len), 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(serve_args(ckpt, port, args.num_requests, max_model_len), tmp / "server.log", args.profile)
    offline: list[float] = []
    server: list[float] = []
    cpu_us: dict[str, list[float]] = {}  # thread -> CPU us per output token, per run
    try:
        for run in range(args.runs):
            prompts = workload(run + 1, args.num_requests, args.prompt_len)  # fresh: no prefix-cache hits
            if llm is not None:
                t, n = run_offline(llm, prompts, args.max_tokens)
                offline.append(n / t)
                print(f"run {run}: offline {n} tokens in {t:.2f} s = {n / t:.0f} tok/s", flush=True)
            cpu0 = thread_cpu_s(proc.pid)
            t, n, events = asyncio.run(run_server_load(port, prompts, args.max_tokens))
            cpu1 = thread_cpu_s(proc.pid)
            assert n == args.num_requests * args.max_tokens, (n, args.num_requests * args.max_tokens)
            server.append(n / t)
            used = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
            # The engine thread: the busiest thread but the loop (Python threads keep the process's name).
            engine = max((k.rsplit(" ", 1)[0] for k in used if k.startswith("thread ")),
                         key=lambda th: used[th + " user"] + used[th + " system"], default=None)
            per_token = {k: 1e6 * used.get(k, 0.0) / n for k in ("event loop user", "event loop system")}
            if engine is not None:
                per_token["engine user"] = 1e6 * used[engine + " user"] / n
                per_token["engine system"] = 1e6 * used[engine + " system"] / n
            per_token["other threads"] = 1e6 * sum(v for k, v in used.items()
                                                   if not k.startswith("event loop") and not k.startswith(f"{engine} ")) / n
            for k, v in per_token.items():
                cpu_us.setdefault(k, []).append(v)
            print(f"run {run}: server  {n} tokens in {t:.2f} s = {n / t:.0f} tok/s ({events} text events); CPU us per "
                  f"token: " + ", ".join(f"{k} {v:.1f}" for k, v in per_token.items()), flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    srv = statistics.median(server)
    off = statistics.median(offline) if offline else None
    print()
    print(f"{args.num_requests} streams x {args.max_tokens} tokens (prompts {args.prompt_len}), torch threads {args.threads}")
    print("| | output tok/s (median) | runs |")
    print("|---|---:|---|")
    if off is not None:
        print(f"| offline LLM.generate | {off:.0f} | {', '.join(f'{x:.0f}' for x in offline)} |")
    print(f"| stoker serve, streamed | {srv:.0f} | {', '.join(f'{x:.0f}' for x in server)} |")
    if off is not None:
        print(f"| server / offline | {srv / off:.2f} | |")
    for k, v in cpu_us.items():
        print(f"| server {k}, CPU us per token | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    if args.profile:
        print(f"profile: {args.profile}")
    if args.json:
        Path(args.json).write_text(json.dumps({"offline_tokens_per_s": offline, "server_tokens_per_s": server,
                                               "offline_median": off, "server_median": srv,
                                               "server_cpu_us_per_token": cpu_us, "num_requests": args.num_requests, "max_tokens": args.max_tokens}, indent=2))


if __name__ == "__main__":
    main()
