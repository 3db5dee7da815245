"""`stoker bench serve|sweep|compare` (and `throughput`, when the engine's module exists).

Flag names follow vLLM's `bench serve` where the concept is the same. Only argparse runs
at registration; the work modules (aiohttp, rich, matplotlib) load when a command runs.
"""

from __future__ import annotations

import argparse
import importlib
import math
from typing import Any


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests/s or 'inf', got {text!r}") from None
    return value


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    g.add_argument("--model", default=None, help="model name to request (default: the first in /v1/models)")
    g.add_argument("--endpoint", default="completions",
                   help="completions | chat | embeddings | a path such as /v1/chat/completions")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before one request counts as failed (timeout)")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", default="random", help="random | sharegpt:PATH | jsonl:PATH")
    g.add_argument("--num-prompts", type=int, default=200, help="requests per run")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens asked per request (random and jsonl without output_len)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1")
    g.add_argument("--random-prefix-len", type=int, default=0, help="tokens of prefix shared by all prompts")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="override ShareGPT output lengths (default: the recorded answer's length)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer dir or tokenizer.json: exact prompt lengths, re-counted outputs")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    g.add_argument("--seed", type=int, default=0)


def _add_report_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000 (milliseconds)")
    g.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", default="50,90,99",
                   help="comma-separated percentiles to report (default 50,90,99)")
    g.add_argument("--disable-tqdm", action="store_true", help="no live progress display")
    g.add_argument("--hardware", default=None,
                   help="GPU name from the roofline table: adds the decode MBU/MFU the throughput implies")
    g.add_argument("--model-config", default=None,
                   help="for --hardware: roofline preset or config.json path (default: --model)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="for --hardware: GPUs the model spans")


def _run(module: str, func: str) -> Any:
    def call(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), func)(args))

    return call


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="measure serving: load generator, sweeps, comparisons",
                                  description="Benchmarks for Stoker and any OpenAI-compatible server.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    serve = sub.add_parser("serve", help="one load run against an OpenAI-compatible endpoint",
                           description="Send --num-prompts streamed requests at --request-rate and report "
                                       "TTFT, TPOT, ITL, E2EL, throughput, goodput and failures.")
    _add_target_args(serve)
    _add_dataset_args(serve)
    g = serve.add_argument_group("load")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="mean requests/s, or inf to send all at once (default inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 smoother, inf = constant")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g = serve.add_argument_group("embeddings (--endpoint embeddings)")
    g.add_argument("--embedding-input", choices=("text", "ids"), default="text",
                   help="send the random prompts as text, or as token ids (needs --tokenizer)")
    g.add_argument("--embedding-inputs-per-request", type=int, default=1,
                   help="inputs in each request's input list (default 1)")
    _add_report_args(serve)
    serve.add_argument("--save-result", default=None, metavar="FILE.json",
                       help="save metrics, settings and every per-request timing")
    serve.set_defaults(func=_run("stoker.bench.serve", "cmd_serve"))

    sweep = sub.add_parser("sweep", help="latency against throughput, from one-at-a-time to saturation",
                           description="Runs a synchronous pass (one request at a time), a max-throughput "
                                       "pass, then --num-rates request rates between the two; prints one "
                                       "table and writes a JSON and a PNG.")
    _add_target_args(sweep)
    _add_dataset_args(sweep)
    g = sweep.add_argument_group("load")
    g.add_argument("--num-rates", type=int, default=4, help="rates between the synchronous and max runs")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="arrivals of the rate runs: 1 = Poisson, inf = constant rate")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap for the max-throughput and rate runs")
    g.add_argument("--max-error-rate", type=float, default=0.05,
                   help="stop the sweep once a run's failed fraction exceeds this (default 0.05)")
    _add_report_args(sweep)
    sweep.add_argument("--save-result", default="stoker-sweep.json", metavar="FILE.json")
    sweep.add_argument("--plot", default=None, metavar="FILE.png", help="default: --save-result with .png")
    sweep.set_defaults(func=_run("stoker.bench.sweep", "cmd_sweep"))

    compare = sub.add_parser("compare", help="ratio of every metric of two saved results (B / A)")
    compare.add_argument("a", metavar="A.json")
    compare.add_argument("b", metavar="B.json")
    compare.set_defaults(func=_run("stoker.bench.compare", "cmd_compare"))

    try:  # the engine's offline throughput benchmark, when this checkout has it
        throughput = importlib.import_module("stoker.bench.throughput")
    except ModuleNotFoundError as exc:
        if exc.name != "stoker.bench.throughput":
            raise
    else:
        throughput.register(sub)
