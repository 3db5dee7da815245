"""Host cost of one streamed output, per request per step, in-process and without sockets: the
server's own share of the per-token work, apart from the model and from uvicorn.

Three pieces, each timed on its own (thread CPU time, medians of --rounds):

* engine thread, `make_output`: a request's cumulative RequestOutput (its token-id list copied)
  from a real RequestState after `--tokens` steps;
* engine thread, the metrics observer (`ServerMetrics.on_outputs`, TTFT / ITL histograms);
* event loop, the fan-out: `RequestStream._put` for --streams streams, their consumers woken and
  each output turned into SSE bytes by the completions endpoint's `_stream` (delta tracking,
  chunk encoding), --tokens steps; us per chunk.

    .venv/bin/python benchmarks/stream_fanout_cpu.py [--streams 256] [--tokens 128] [--rounds 5] [--json out.json]
    .venv/bin/python benchmarks/stream_fanout_cpu.py --smoke

Run it on two checkouts alternately (PYTHONPATH=<checkout>) to compare them; the script itself
takes stoker from PYTHONPATH when set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stoker.engine.async_engine import RequestStream  # noqa: E402
from stoker.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from stoker.sampling_params import SamplingParams  # noqa: E402


class _NoAbort:
    def abort(self, request_id: str) -> None:
        pass


class _NoTiming:
    """The server state `_stream` reads at the end (request timing off)."""

    class metrics:  # noqa: N801 - mirrors ServerState.metrics.wall
        class wall:  # noqa: N801
            @staticmethod
            def request_steps(request_id: str) -> None:
                return None


def _outputs(num_streams: int, step: int, num_tokens: int, token_ids: list[list[int]], texts: list[str]) -> list[RequestOutput]:
    """Step `step`'s cumulative outputs, as the engine hands them over (one token and 3 chars more)."""
    last = step == num_tokens - 1
    outs = []
    for i in range(num_streams):
        token_ids[i].append(100 + step % 900)
        texts[i] += " ab"
        comp = CompletionOutput(0, texts[i], list(token_ids[i]), -1.0, None, "length" if last else None)
        outs.append(RequestOutput(f"r{i}", None, [1, 2, 3], [comp], last, RequestMetrics(0.0, 0.0, 0.0)))
    return outs


async def _fanout(num_streams: int, num_tokens: int) -> tuple[float, int]:
    """(event-loop CPU seconds for the puts, wake-ups and encoding, content chunks made)."""
    from stoker.server.generate.completion import OpenAIServingCompletion
    from stoker.server.generate.protocol import CompletionRequest

    serving = OpenAIServingCompletion(_NoTiming())  # type: ignore[arg-type]
    req = CompletionRequest(model="bench", prompt=[1, 2, 3], max_tokens=num_tokens, stream=True, ignore_eos=True,
                            stream_options={"include_usage": True})
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    streams = [RequestStream(_NoAbort(), f"r{i}") for i in range(num_streams)]  # type: ignore[arg-type]
    chunks = [0]

    async def consume(stream: RequestStream) -> None:
        async for chunk in serving._stream("cmpl-x", "bench", 1, [stream], [params], [(None, [1, 2, 3])], None, req):
            chunks[0] += b'"text":' in chunk  # not the usage chunk nor [DONE]

    tasks = [asyncio.ensure_future(consume(s)) for s in streams]
    await asyncio.sleep(0)
    token_ids: list[list[int]] = [[] for _ in range(num_streams)]
    texts = [""] * num_streams
    spent = 0.0
    for step in range(num_tokens):
        outs = _outputs(num_streams, step, num_tokens, token_ids, texts)  # the engine's work: not timed
        start = time.thread_time()
        for stream, out in zip(streams, outs):
            stream._put(out)
        for _ in range(3):  # wake-ups run, each consumer encodes its chunk and waits again
            await asyncio.sleep(0)
        spent += time.thread_time() - start
    start = time.thread_time()
    await asyncio.gather(*tasks)
    spent += time.thread_time() - start
    return spent, chunks[0]


def _make_output_us(num_streams: int, num_tokens: int) -> float:
    """us per `make_output` of a request that has generated num_tokens tokens."""
    from stoker.core.sequence import Sequence
    from stoker.engine.input_processor import EngineRequest
    from stoker.engine.output_processor import OutputProcessor, RequestState

    states = []
    for i in range(num_streams):
        params = SamplingParams(max_tokens=num_tokens + 1)
        seq = Sequence(f"r{i}", [1, 2, 3], params)
        seq.output_token_ids.extend(range(num_tokens))
        states.append(RequestState(EngineRequest(f"r{i}", None, [1, 2, 3], params, time.time()), [seq], RequestMetrics(0.0)))
    start = time.thread_time()
    for state in states:
        OutputProcessor.make_output(state)
    return 1e6 * (time.thread_time() - start) / num_streams


def _observer_us(num_streams: int, num_tokens: int) -> float:
    """us per output in `ServerMetrics.on_outputs` over a whole stream of num_tokens steps."""
    from stoker.server.observe.metrics import ServerMetrics

    metrics = ServerMetrics("bench", lambda: None)
    metrics.engine_loaded(4096)
    for i in range(num_streams):
        metrics.on_added(f"r{i}", SamplingParams(max_tokens=num_tokens))
    token_ids: list[list[int]] = [[] for _ in range(num_streams)]
    texts = [""] * num_streams
    spent = 0.0
    for step in range(num_tokens):
        outs = _outputs(num_streams, step, num_tokens, token_ids, texts)
        start = time.thread_time()
        metrics.on_outputs(outs, time.time())
        spent += time.thread_time() - start
    return 1e6 * spent / (num_streams * num_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="8 streams, 8 tokens, one round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.streams, args.tokens, args.rounds = 8, 8, 1
    import logging

    logging.disable(logging.INFO)  # the observer logs each finished request
    try:
        import uvloop
        run: Any = uvloop.run  # what uvicorn runs the server on when it is installed
    except ImportError:
        run = asyncio.run
    rows: dict[str, list[float]] = {"engine thread: make_output, us per output": [],
                                    "engine thread: metrics observer, us per output": [],
                                    "event loop: put, wake, encode, us per chunk": []}
    for _ in range(args.rounds):
        rows["engine thread: make_output, us per output"].append(_make_output_us(args.streams, args.tokens))
        rows["engine thread: metrics observer, us per output"].append(_observer_us(args.streams, args.tokens))
        spent, chunks = run(_fanout(args.streams, args.tokens))
        assert chunks == args.streams * args.tokens, (chunks, args.streams * args.tokens)
        rows["event loop: put, wake, encode, us per chunk"].append(1e6 * spent / chunks)
    print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds, Python {sys.version.split()[0]}")
    print("| per streamed output | median | rounds |")
    print("|---|---:|---|")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.median(vals):.2f} | {', '.join(f'{v:.2f}' for v in vals)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"streams": args.streams, "tokens": args.tokens, "rounds": rows}, indent=2))


if __name__ == "__main__":
    main()
