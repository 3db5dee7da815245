"""Is the load generator ever the bottleneck? Throughput and TTFT overhead of `bench serve`.

Starts the instant-streaming test double (`stoker.bench.doubles`, mode instant) as a
separate process on 127.0.0.1, then measures in this process:

1. sustained throughput: requests/s and streamed content chunks/s of `run_load` with
   unlimited rate and a concurrency cap (the double answers at once, so the client-side
   cost per request and per chunk is what limits the rate);
2. TTFT overhead: sequential requests, alternating between the bench client
   (`stoker.bench.client.send_request`) and a minimal raw-socket reference client (one
   keep-alive connection, pre-encoded request bytes, clock stops at the first received
   bytes containing content). The difference of median TTFTs is what the generator's own
   machinery adds to every TTFT it reports.

Usage: .venv/bin/python benchmarks/bench_client_overhead.py [--requests 2000] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.machine import cpu_model  # noqa: E402
from stoker.bench.client import Endpoint, RequestSpec, send_request
from stoker.bench.runner import LoadConfig, auth_headers, run_load


def start_double(chunk_writes: bool) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "stoker.bench.doubles", "--mode", "instant", "--port", "0"]
    proc = subprocess.Popen(cmd + (["--chunk-writes"] if chunk_writes else []), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        proc.kill()
        raise RuntimeError("the test double did not start")
    return proc, int(line[1])


async def throughput(port: int, n: int, tokens: int, concurrency: int) -> tuple[float, float, int]:
    ep = Endpoint(f"http://127.0.0.1:{port}/v1/completions", "double-model", False, auth_headers(None))
    specs = [RequestSpec("hello world", 2, tokens)] * n
    out = await run_load(ep, specs, LoadConfig(max_concurrency=concurrency))
    ok = [r for r in out.results if r.success]
    chunks = sum(r.num_chunks for r in ok)
    return len(ok) / out.duration, chunks / out.duration, len(out.results) - len(ok)


async def ttft_pair(port: int, n: int, tokens: int) -> tuple[list[float], list[float]]:
    """Alternate bench-client and reference requests so drift hits both equally."""
    ep = Endpoint(f"http://127.0.0.1:{port}/v1/completions", "double-model", False, auth_headers(None))
    spec = RequestSpec("hello world", 2, tokens)
    body = json.dumps(ep.payload(spec)).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ours: list[float] = []
    ref: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for i in range(2 * n + 20):  # the first 20 warm both paths up and are dropped
            if i % 2 == 0:
                r = await send_request(session, ep, spec, time.perf_counter())
                assert r.success, r.error
                if i >= 20:
                    ours.append(r.ttft)
            else:
                t0 = time.perf_counter()
                writer.write(raw)
                buf = b""
                first = None
                while not buf.endswith(b"0\r\n\r\n"):  # the chunked body's terminator
                    buf += await reader.read(65536)
                    if first is None and b'"text"' in buf:
                        first = time.perf_counter() - t0
                if i >= 20:
                    ref.append(first)
    writer.close()
    return ours, ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per throughput repeat")
    ap.add_argument("--tokens", type=int, default=64, help="streamed tokens per request")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttft-requests", type=int, default=500)
    args = ap.parse_args()
    import os

    cpu = cpu_model()
    print(f"machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, aiohttp {aiohttp.__version__}")
    all_ok = True
    # "one write": the double sends a whole response in one write, so many SSE events share
    # a read; "per-token writes": one write and event-loop turn per token, as a real server
    # streams, so the client pays one read per chunk (the harder case).
    for chunk_writes in (False, True):
        proc, port = start_double(chunk_writes)
        try:
            runs = [asyncio.run(throughput(port, args.requests, args.tokens, args.concurrency))
                    for _ in range(args.repeats)]
            ours, ref = asyncio.run(ttft_pair(port, args.ttft_requests, 16))
        finally:
            proc.terminate()
            proc.wait(10)
        rps = statistics.median(r[0] for r in runs)
        cps = statistics.median(r[1] for r in runs)
        failed = sum(r[2] for r in runs)
        m_ours, m_ref = statistics.median(ours) * 1e3, statistics.median(ref) * 1e3
        print(f"== double streams with {'per-token writes' if chunk_writes else 'one write per response'}")
        print(f"throughput ({args.repeats} repeats x {args.requests} requests x {args.tokens} tokens, "
              f"concurrency {args.concurrency}; median):")
        print(f"  requests/s        {rps:10.0f}   (each: {', '.join(f'{r[0]:.0f}' for r in runs)})")
        print(f"  chunks/s          {cps:10.0f}   (each: {', '.join(f'{r[1]:.0f}' for r in runs)})")
        print(f"  failed            {failed:10d}")
        print(f"TTFT, sequential, {len(ours)} requests each, 16 tokens, interleaved:")
        print(f"  bench client median TTFT   {m_ours:7.3f} ms  (p90 {statistics.quantiles(ours, n=10)[-1]*1e3:.3f})")
        print(f"  raw-socket reference       {m_ref:7.3f} ms  (p90 {statistics.quantiles(ref, n=10)[-1]*1e3:.3f})")
        print(f"  overhead (median diff)     {m_ours - m_ref:7.3f} ms")
        all_ok &= rps >= 300 and cps >= 10_000 and (m_ours - m_ref) < 1.0 and failed == 0
    print("targets (>= 300 req/s, >= 10,000 chunks/s, < 1 ms TTFT overhead, no failures):",
          "MET" if all_ok else "NOT MET")


if __name__ == "__main__":
    main()
