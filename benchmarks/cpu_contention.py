"""CPU serving latency with and without a competing busy process (issue 12).

A fixed request (prompt "The capital of France is", 64 output tokens, greedy, ignore_eos) is
sent to `stoker serve` (the demo model, CPU) 100 times one after another; p50 / p99 / max of
its end-to-end latency, on an idle machine and then while one other process spins on a core
(`while True: pass`, stopped when the phase ends). Each configuration gets its own server
process, started with the environment given, so the thread settings are fixed at start as a
user would set them. Configurations run one after another, and the whole list is repeated
(--repeats) so machine drift hits every configuration; the table gives medians over repeats.

    .venv/bin/python benchmarks/cpu_contention.py [--sends 100] [--repeats 2] [--json out.json]

Configurations: CONFIGS below (the server process's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.machine import isa as machine_isa  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, dict[str, str]] = {
    # what `stoker serve` does with no thread settings (stoker/cpu_runtime.py: OMP_WAIT_POLICY=PASSIVE)
    "default": {},
    # before issue 12: libgomp's own default, workers spin 300k iterations before sleeping
    "spin300k": {"GOMP_SPINCOUNT": "300000"},
    # a short spin, then sleep
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin30k": {"GOMP_SPINCOUNT": "30000"},
    # the workaround: stable, but one core for big batches
    "omp1": {"OMP_NUM_THREADS": "1"},
}
BODY = {"model": "stoker-demo", "prompt": "The capital of France is", "max_tokens": 64, "temperature": 0,
        "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str) -> float:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(BODY).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    assert out["usage"]["completion_tokens"] == 64, out
    return time.perf_counter() - start


def _start_server(env_extra: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker", "serve", "--port", str(port), "--disable-uvicorn-access-log",
         "--uvicorn-log-level", "warning"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/health/ready", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
    proc.kill()
    raise RuntimeError("server not ready after 120 s")


def _phase(url: str, sends: int) -> dict[str, float]:
    times = sorted(_post(url) for _ in range(sends))
    return {"p50": statistics.median(times), "p99": times[min(len(times) - 1, int(0.99 * len(times)))], "max": times[-1]}


def run_config(env_extra: dict[str, str], sends: int) -> dict[str, dict[str, float]]:
    proc, url = _start_server(env_extra)
    try:
        for _ in range(5):  # warm-up
            _post(url)
        idle = _phase(url, sends)
        # One competing process spinning on a core, bounded in time (killed below regardless).
        busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 600\nwhile time.time() < end: pass"])
        try:
            time.sleep(0.5)
            contended = _phase(url, sends)
        finally:
            busy.kill()
            busy.wait()
        return {"idle": idle, "contended": contended}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sends", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict[str, list] = {name: [] for name in args.configs}
    for rep in range(args.repeats):
        for name in args.configs:
            r = run_config(CONFIGS[name], args.sends)
            results[name].append(r)
            print(f"repeat {rep} {name:16s} idle p50 {r['idle']['p50'] * 1e3:7.1f} p99 {r['idle']['p99'] * 1e3:7.1f} | "
                  f"contended p50 {r['contended']['p50'] * 1e3:7.1f} p99 {r['contended']['p99'] * 1e3:7.1f} "
                  f"max {r['contended']['max'] * 1e3:7.1f} ms", flush=True)
    isa = machine_isa()
    print(f"\n{cpu_model()} ({isa}), {os.cpu_count()} CPUs; {args.sends} sends per phase, medians of {args.repeats} repeats (ms)")
    print(f"{'config':16s} {'idle p50':>9s} {'idle p99':>9s} {'busy p50':>9s} {'busy p99':>9s} {'busy/idle p50':>14s} {'busy p99/p50':>13s}")
    summary = {}
    for name, runs in results.items():
        med = {phase: {k: statistics.median(r[phase][k] for r in runs) for k in ("p50", "p99", "max")} for phase in ("idle", "contended")}
        summary[name] = med
        i, c = med["idle"], med["contended"]
        print(f"{name:16s} {i['p50'] * 1e3:9.1f} {i['p99'] * 1e3:9.1f} {c['p50'] * 1e3:9.1f} {c['p99'] * 1e3:9.1f} "
              f"{c['p50'] / i['p50']:14.2f} {c['p99'] / c['p50']:13.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "isa": isa, "runs": results, "medians": summary}, indent=2))


if __name__ == "__main__":
    main()
