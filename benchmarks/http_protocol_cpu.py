"""Server CPU per request for the two HTTP protocols `stoker serve` can run
(server/http/limits.py: httptools when installed, else h11), on a bare FastAPI app.

Each round starts, per protocol, a subprocess serving one POST route (a pydantic body like an
embeddings request; a 2 KB JSON answer like a base64 384-float vector) with
`header_timeout_protocol`'s class, then drives it with `--requests` POSTs at concurrency 32
from an aiohttp client in this process; server CPU = the subprocess's user + system time over
the load (/proc/PID/stat), per request. Protocols alternate within each of `--rounds` rounds;
medians.

    .venv/bin/python benchmarks/http_protocol_cpu.py [--rounds 3] [--requests 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import cpu_model, isa  # noqa: E402

_SERVER = r"""
import sys
from fastapi import FastAPI
from pydantic import BaseModel
import uvicorn
if sys.argv[1] == "h11":
    sys.modules["httptools"] = None  # what a machine without httptools runs
from stoker.server.http.limits import header_timeout_protocol

app = FastAPI()

class Body(BaseModel):
    model: str | None = None
    input: str | list[str]
    encoding_format: str = "float"

@app.post("/v1/embeddings")
async def embeddings(body: Body) -> dict:
    return {"object": "list", "model": body.model, "data": [{"object": "embedding", "index": 0, "embedding": "A" * 2048}]}

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), http=header_timeout_protocol(10.0), log_level="warning",
            access_log=False)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(url: str, n: int, concurrency: int = 32) -> None:
    import aiohttp

    body = {"model": "m", "input": "a few words of a query " * 3, "encoding_format": "base64"}
    left = [n]
    async with aiohttp.ClientSession() as session:
        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with session.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure(protocol: str, n: int) -> tuple[float, float]:
    """(server CPU us per request, requests/s) for one protocol."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, protocol, str(port)], cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("server did not start") from None
                time.sleep(0.1)
        asyncio.run(_load(url, 300))  # warm-up
        cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
        asyncio.run(_load(url, n))
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(proc.pid) - cpu0
        return 1e6 * cpu / n, n / wall
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4000)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"h11": [], "httptools": []}
    for r in range(args.rounds):
        for protocol in results:
            results[protocol].append(measure(protocol, args.requests))
        print(f"round {r + 1}: " + ", ".join(f"{p} {v[-1][0]:.0f} us/request ({v[-1][1]:.0f} req/s)"
                                            for p, v in results.items()), flush=True)
    print(f"\nCPU: {cpu_model()} ({isa()}), {os.cpu_count()} CPUs; {args.requests} POSTs at concurrency 32 per run; "
          f"medians of {args.rounds} rounds; load average {os.getloadavg()[0]:.2f}\n")
    print("| protocol | server CPU per request | requests/s |")
    print("|---|---:|---:|")
    for protocol, v in results.items():
        print(f"| {protocol} | {statistics.median(c for c, _ in v):.0f} us | {statistics.median(q for _, q in v):.0f} |")


if __name__ == "__main__":
    main()
