"""What does `stoker router` add to TTFT? Streamed requests direct to a server vs through the router.

Upstreams, each in its own process on 127.0.0.1:
- `instant`: a minimal server (this file, --serve-instant) that answers /v1/completions with
  three SSE chunks at once: the TTFT measured is then HTTP plus the router, nothing else.
- `stoker`: `python -m stoker serve` with its built-in demo model (random weights), streaming
  8 tokens: the router's share beside a real engine's TTFT (noisier: the engine's own time varies).
The router is `python -m stoker router --worker-urls UPSTREAM` in a process of its own, as
deployed; with --compare CHECKOUT, a second router from another checkout runs beside it (before
and after a change, in the same run). The client (this process, one keep-alive httpx
connection per target) sends the same streamed /v1/completions request to every target in
turn (direct, router, compare; the order rotated each round), so machine drift hits all alike,
and times each from sending to the first body chunk. Per run and target: the median, 10th and
90th percentiles over --requests requests (on a machine shared with other work the 10th
percentile is the least disturbed figure), the same minus the direct request's ("added"), the
CPU time the process spent per request (/proc/PID/stat; load on other cores inflates it far
less than wall time) and the 1-minute load average. The added TTFT is the median of the runs'.

    .venv/bin/python benchmarks/router_overhead.py [--requests 300] [--runs 3] [--upstreams instant stoker]
        [--compare /tmp/before] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

BODY = {"model": "demo", "prompt": "The router adds how much to the first token", "max_tokens": 8,
        "temperature": 0, "stream": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_instant(port: int) -> None:
    """The `instant` upstream: vLLM's shape of a streamed completion, with no engine behind it."""
    app = FastAPI()
    chunks = [("data: " + json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "demo",
                                      "choices": [{"index": 0, "text": w, "finish_reason": None}]}) + "\n\n").encode()
              for w in ("a", " b", " c")] + [b"data: [DONE]\n\n"]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        await request.body()

        async def gen():
            for c in chunks:
                yield c
        return StreamingResponse(gen(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start(cmd: list[str], url: str, log: Path, timeout_s: float = 180, env: dict[str, str] | None = None,
          cwd: str | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env or {**os.environ}, cwd=cwd)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:5]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{url} not ready: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def ttft(client: httpx.Client, url: str) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=BODY) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        first = None
        for _ in r.iter_raw():  # read to the end: the connection goes back to the pool whole
            if first is None:
                first = time.perf_counter() - t0
    return first


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def p10(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[0]


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


def measure(urls: list[str], requests: int) -> list[list[float]]:
    """TTFTs (s) per target, requests interleaved: each round sends one request to every target,
    the order rotated from round to round so that none always goes first."""
    out: list[list[float]] = [[] for _ in urls]
    clients = [httpx.Client(timeout=60) for _ in urls]
    try:
        for _ in range(10):  # warm every path (connections, first-request work)
            for c, u in zip(clients, urls):
                ttft(c, u)
        for i in range(requests):
            for k in range(len(urls)):
                j = (i + k) % len(urls)
                out[j].append(ttft(clients[j], urls[j]))
    finally:
        for c in clients:
            c.close()
    return out


def router_cmd(upstream: str, port: int) -> list[str]:
    return [sys.executable, "-m", "stoker", "router", "--worker-urls", upstream, "--port", str(port)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per side per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--upstreams", nargs="+", default=["instant", "stoker"], choices=["instant", "stoker"])
    ap.add_argument("--compare", default=None, metavar="CHECKOUT",
                    help="also run the router of another checkout (git worktree add /tmp/before COMMIT), "
                         "interleaved with this one's: before and after in the same run")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    ap.add_argument("--serve-instant", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_instant is not None:
        serve_instant(args.serve_instant)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_model, isa

    here = str(Path(__file__).resolve().parents[1])
    routers = [("router", here)] + ([("compare", str(Path(args.compare).resolve()))] if args.compare else [])
    print(f"machine: {cpu_model()} ({isa()}), {os.cpu_count()} CPUs, shared with other work; load average "
          f"{os.getloadavg()[0]:.2f} at the start; {args.requests} streamed requests per target per run, "
          "interleaved")
    for name, path in routers:
        print(f"{name}: {path} (commit {git_head(path)})")
    print(f"{'upstream':<9} {'run':>3} {'target':<8} {'median ms':>9} {'added ms':>8} {'p10 ms':>7} {'added p10':>9} "
          f"{'p90 ms':>7} {'added p90':>9} {'CPU us/req':>10} {'load':>5}")
    results = []
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        for kind in args.upstreams:
            port = free_port()
            up = f"http://127.0.0.1:{port}"
            cmd = ([sys.executable, __file__, "--serve-instant", str(port)] if kind == "instant" else
                   [sys.executable, "-m", "stoker", "serve", "--served-model-name", "demo", "--host", "127.0.0.1",
                    "--port", str(port), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"])
            procs = [start(cmd, up, Path(tmp) / f"{kind}.log")]
            urls = [up]
            try:
                for name, path in routers:
                    rport = free_port()
                    urls.append(f"http://127.0.0.1:{rport}")
                    procs.append(start(router_cmd(up, rport), urls[-1], Path(tmp) / f"{name}.log",
                                       env={**os.environ, "PYTHONPATH": path}, cwd=path))
                added: dict[str, list[float]] = {name: [] for name, _ in routers}
                for run in range(args.runs):
                    cpu0 = [cpu_seconds(p.pid) for p in procs]
                    ttfts = measure(urls, args.requests)
                    n = args.requests + 10  # measured + warm-up requests per target
                    cpu = [(cpu_seconds(p.pid) - c) / n for p, c in zip(procs, cpu0)]
                    cpu[0] /= len(routers) + 1  # the upstream served every target
                    load = os.getloadavg()[0]
                    direct = ttfts[0]
                    for k, name in enumerate(["direct"] + [r for r, _ in routers]):
                        t = ttfts[k]
                        row = {"upstream": kind, "run": run, "target": name, "median_ms": statistics.median(t) * 1e3,
                               "p10_ms": p10(t) * 1e3, "p90_ms": p90(t) * 1e3, "cpu_us_per_request": cpu[k] * 1e6,
                               "load_1min": load}
                        row.update({f"added_{q}_ms": row[f"{q}_ms"] - f(direct) * 1e3
                                    for q, f in (("median", statistics.median), ("p10", p10), ("p90", p90))})
                        results.append(row)
                        if name != "direct":
                            added[name].append(row["added_median_ms"])
                        print(f"{kind:<9} {run:>3} {name:<8} {row['median_ms']:>9.3f} {row['added_median_ms']:>8.3f} "
                              f"{row['p10_ms']:>7.3f} {row['added_p10_ms']:>9.3f} {row['p90_ms']:>7.3f} "
                              f"{row['added_p90_ms']:>9.3f} {row['cpu_us_per_request']:>10.0f} {load:>5.2f}")
                for name, _ in routers:
                    print(f"{kind:<9} {name}: added TTFT, median of runs: {statistics.median(added[name]):.3f} ms")
            finally:
                for p in procs:
                    p.terminate()
                    p.wait(30)
    if args.json:
        Path(args.json).write_text(json.dumps({"routers": dict(routers), "results": results}, indent=2))
    return 0


def git_head(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
