"""Event-loop CPU per /v1/embeddings request, in process: the app `stoker serve DIR` builds,
driven through ASGI by `--concurrency` in-memory clients (no sockets, no HTTP parsing), so the
figure is what the server's own code and its framework cost the event loop per request.

    .venv/bin/python benchmarks/embeddings_loop_cpu.py [--requests 3000] [--rounds 3]
                                                       [--concurrency 32] [--profile tottime]

Model and batcher as benchmarks/embeddings_server_cpu.py (the MiniLM-shaped random embedder,
--max-batch-size 32 --max-queue-delay-microseconds 2000, queries of 3-10 words, base64). The
event loop is the main thread: its CPU (time.thread_time) over the timed requests, divided
by their number; the forward runs on the model's instance threads and is not counted. Each
round runs the requests once after a warm-up of 300; the figure is the median of the rounds.
`--profile SORT` prints cProfile's main-thread table for one more round (profiled, slower).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.embeddings_cpu import MINILM, WORKLOADS, make_inputs  # noqa: E402
from benchmarks.embeddings_server_cpu import BATCHER  # noqa: E402
from benchmarks.machine import cpu_model, isa  # noqa: E402


async def _one(app: Any, text: str) -> None:
    body = json.dumps({"model": "m", "input": text, "encoding_format": "base64"}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:  # after the body, a client that stays connected
            await asyncio.Event().wait()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    status: list[int] = []

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            status.append(msg["status"])

    await app(scope, receive, send)
    assert status == [200], status


async def _load(app: Any, texts: list[str], concurrency: int) -> None:
    queue = list(texts)

    async def client() -> None:
        while queue:
            await _one(app, queue.pop())

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def _measure(model_dir: Path, args: argparse.Namespace) -> list[float]:
    from stoker.cli import build_parser
    from stoker.server.cli import build_app

    app, _ = build_app(build_parser().parse_args(["serve", str(model_dir), "--served-model-name", "m", *BATCHER]))
    texts = make_inputs(args.requests, words=WORKLOADS["queries"])
    per_request = []
    async with app.router.lifespan_context(app):
        while not app.state.stoker.pooling.ready:
            await asyncio.sleep(0.05)
        await _load(app, texts[:300], args.concurrency)
        for r in range(args.rounds):
            c0, t0 = time.thread_time(), time.perf_counter()
            await _load(app, texts, args.concurrency)
            cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
            per_request.append(cpu / len(texts) * 1e6)
            print(f"round {r + 1}: event loop {per_request[-1]:.1f} us/request, {len(texts) / wall:.1f} requests/s", flush=True)
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            await _load(app, texts, args.concurrency)
            prof.disable()
            pstats.Stats(prof).sort_stats(args.profile).print_stats(40)
    return per_request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--profile", default=None, help="cProfile sort key for one extra, profiled round (e.g. tottime)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from stoker.testing.tiny_pooling import make_bert_embedder

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "minilm", **MINILM)
        rounds = asyncio.run(_measure(model_dir, args))
    print(f"\n{cpu_model()} ({isa()}), {os.cpu_count()} CPUs; {args.requests} queries at c = {args.concurrency}, in process: "
          f"event loop {statistics.median(rounds):.1f} us/request (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
