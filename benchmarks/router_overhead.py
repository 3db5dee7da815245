"""What does `stoker router` add to TTFT? Streamed requests direct to a server vs through the router.

Upstreams, each in its own process on 127.0.0.1:
- `instant`: a minimal server (this file, --serve-instant) that answers /v1/completions with
  three SSE chunks at once: the TTFT measured is then HTTP plus the router, nothing else.
- `stoker`: `python -m stoker serve` with its built-in demo model (random weights), streaming
  8 tokens: the router's share beside a real engine's TTFT (noisier: the engine's own time varies).
The router is `python -m stoker router --worker-urls UPSTREAM` in a process of its own, as
deployed. The client (this process, one keep-alive httpx connection per target) sends the same
streamed /v1/completions request alternately direct and through the router, so machine drift
hits both sides alike, and times each from sending to the first body chunk. Per run: the
median and the 10th percentile over --requests requests per side (on a machine shared with
other work the 10th percentile is the least disturbed figure), and the CPU time the router and
the upstream processes spent per request (/proc/PID/stat), which load on other cores inflates
far less than wall time. The added TTFT is the median of the runs' differences.

    .venv/bin/python benchmarks/router_overhead.py [--requests 300] [--runs 3] [--upstreams instant stoker]
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


def start(cmd: list[str], url: str, log: Path, timeout_s: float = 180) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
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


def measure(direct: str, routed: str, requests: int) -> tuple[list[float], list[float]]:
    """TTFTs (s) direct and routed, requests interleaved."""
    d, r = [], []
    with httpx.Client(timeout=60) as cd, httpx.Client(timeout=60) as cr:
        for _ in range(10):  # warm both paths (connections, first-request work)
            ttft(cd, direct), ttft(cr, routed)
        for i in range(requests):
            if i % 2:
                d.append(ttft(cd, direct))
                r.append(ttft(cr, routed))
            else:
                r.append(ttft(cr, routed))
                d.append(ttft(cd, direct))
    return d, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per side per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--upstreams", nargs="+", default=["instant", "stoker"], choices=["instant", "stoker"])
    ap.add_argument("--serve-instant", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_instant is not None:
        serve_instant(args.serve_instant)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_model, isa

    print(f"machine: {cpu_model()} ({isa()}), {os.cpu_count()} CPUs, shared with other work; "
          f"{args.requests} streamed requests per side per run, interleaved")
    print(f"{'upstream':<9} {'run':>3} {'direct ms':>10} {'routed ms':>10} {'added ms':>9} {'direct p10':>10} "
          f"{'routed p10':>10} {'added p10':>9} {'router CPU us/req':>17} {'upstream CPU us/req':>19}")
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        for kind in args.upstreams:
            port = free_port()
            up = f"http://127.0.0.1:{port}"
            cmd = ([sys.executable, __file__, "--serve-instant", str(port)] if kind == "instant" else
                   [sys.executable, "-m", "stoker", "serve", "--served-model-name", "demo", "--host", "127.0.0.1",
                    "--port", str(port), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"])
            rport = free_port()
            router = f"http://127.0.0.1:{rport}"
            procs = [start(cmd, up, Path(tmp) / f"{kind}.log")]
            try:
                procs.append(start([sys.executable, "-m", "stoker", "router", "--worker-urls", up, "--port",
                                    str(rport)], router, Path(tmp) / "router.log"))
                added, added10 = [], []
                for run in range(args.runs):
                    c_router, c_up = cpu_seconds(procs[1].pid), cpu_seconds(procs[0].pid)
                    d, r = measure(up, router, args.requests)
                    n = len(d) + 10  # measured + warm-up requests through the router
                    cpu_router = (cpu_seconds(procs[1].pid) - c_router) / n
                    cpu_up = (cpu_seconds(procs[0].pid) - c_up) / (2 * n)  # it served both sides
                    md, mr = statistics.median(d), statistics.median(r)
                    added.append(mr - md)
                    added10.append(p10(r) - p10(d))
                    print(f"{kind:<9} {run:>3} {md * 1e3:>10.3f} {mr * 1e3:>10.3f} {(mr - md) * 1e3:>9.3f} "
                          f"{p10(d) * 1e3:>10.3f} {p10(r) * 1e3:>10.3f} {added10[-1] * 1e3:>9.3f} "
                          f"{cpu_router * 1e6:>17.0f} {cpu_up * 1e6:>19.0f}")
                print(f"{kind:<9} added TTFT, median of runs: {statistics.median(added) * 1e3:.3f} ms "
                      f"(10th percentiles: {statistics.median(added10) * 1e3:.3f} ms)")
            finally:
                for p in procs:
                    p.terminate()
                    p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
