"""`stoker bench serve --endpoint embeddings`: load on POST /v1/embeddings (issue 18, part 5).

Same arrivals, concurrency cap, prompts and failure accounting as the generative modes; an
embedding answer is one JSON body, so the only latency is E2EL (request sent -> whole body
read). Throughput is requests/s, inputs/s (a request may carry several inputs,
`--embedding-inputs-per-request`) and prompt tokens/s (vLLM's `total_token_throughput`).

The server's batch sizes: `/metrics` is scraped before and after the run and any histogram
whose name contains `batch_size` (per `model_name` when labelled) is differenced, giving the
distribution of the batches formed during exactly this run. A server that exports none gives
{"available": False, "why": ...}; the client-side view (peak and mean requests in flight)
is always in the result.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from stoker.bench import server_wall
from stoker.bench.client import (
    BAD_PAYLOAD,
    CONNECTION,
    TIMEOUT,
    LiveCounters,
    RequestResult,
    RequestSpec,
)
from stoker.bench.metrics import Summary, peak_concurrency, percentile_key

INPUT_KINDS = ("text", "ids")


def is_embeddings(endpoint: str) -> bool:
    return endpoint in ("embeddings", "/v1/embeddings") or endpoint.rstrip("/").endswith("/embeddings")


@dataclass(frozen=True)
class EmbedEndpoint:
    """Where and what to send; `ids` sends token-id lists instead of texts."""

    url: str
    model: str
    headers: dict[str, str]
    inputs_per_request: int = 1

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        ids = getattr(spec, "token_ids", None)
        one: Any = list(ids) if ids is not None else spec.prompt
        return {"model": self.model, "input": [one] * self.inputs_per_request, "encoding_format": "float"}


@dataclass(frozen=True)
class IdsSpec(RequestSpec):
    """A random prompt as token ids (the ids the tokenizer gives for the dataset's text)."""

    token_ids: tuple[int, ...] = ()


async def send_embedding(session: aiohttp.ClientSession, endpoint: EmbedEndpoint, spec: RequestSpec,
                         t0: float, counters: LiveCounters | None = None) -> RequestResult:
    """One POST; never raises for server misbehaviour. `num_chunks` holds the inputs embedded."""
    result = RequestResult(prompt_len=spec.prompt_len * endpoint.inputs_per_request)
    body = json.dumps(endpoint.payload(spec)).encode()
    sent = time.perf_counter()
    result.start = sent - t0
    try:
        async with session.post(endpoint.url, data=body, headers=endpoint.headers) as resp:
            raw = await resp.read()
            done = time.perf_counter()
            if resp.status != 200:
                text = raw.decode(errors="replace").strip()
                result.fail(f"http_{resp.status}", text or resp.reason or "")
            else:
                _check(json.loads(raw), endpoint.inputs_per_request, result)
                if result.error_reason is None:
                    result.success = True
                    result.latency = done - sent
                    if counters is not None:
                        counters.chunks += result.num_chunks
    except asyncio.TimeoutError:
        result.fail(TIMEOUT, "request timed out (see --request-timeout)")
    except ValueError as exc:  # not JSON
        result.fail(BAD_PAYLOAD, f"not JSON: {exc}")
    except (aiohttp.ClientError, OSError) as exc:
        result.fail(CONNECTION, f"{type(exc).__name__}: {exc}")
    result.end = time.perf_counter() - t0
    return result


def _check(answer: Any, expected: int, result: RequestResult) -> None:
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        result.fail(BAD_PAYLOAD, f"no data list in the answer: {str(answer)[:200]}")
        return
    good = [d for d in data if isinstance(d, dict) and isinstance(d.get("embedding"), (list, str)) and d["embedding"]]
    if len(good) != expected:
        result.fail(BAD_PAYLOAD, f"{len(good)} embeddings for {expected} inputs")
        return
    result.num_chunks = len(good)
    usage = answer.get("usage") or {}
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_tokens = usage["prompt_tokens"]


# ---------------------------------------------------------------------------------------- metrics
@dataclass
class EmbedMetrics:
    duration: float
    completed: int
    failed: int
    failures: dict[str, int]
    total_inputs: int
    total_input_tokens: int
    request_throughput: float
    input_throughput: float
    total_token_throughput: float
    max_concurrent_requests: int
    mean_concurrency: float
    mean_input_len: float
    e2el: Summary

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "duration": self.duration, "completed": self.completed, "failed": self.failed,
            "failures": dict(self.failures), "total_inputs": self.total_inputs,
            "total_input_tokens": self.total_input_tokens, "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput, "total_token_throughput": self.total_token_throughput,
            "max_concurrent_requests": self.max_concurrent_requests, "mean_concurrency": self.mean_concurrency,
            "mean_input_len": self.mean_input_len,
            "mean_e2el_ms": self.e2el.mean, "median_e2el_ms": self.e2el.median, "std_e2el_ms": self.e2el.std,
        }
        for p, v in self.e2el.percentiles.items():
            out[f"{percentile_key(p)}_e2el_ms"] = v
        return out


def compute_embed_metrics(results: Sequence[RequestResult], duration: float, *,
                          percentiles: Sequence[float] = (50, 90, 99)) -> EmbedMetrics:
    """Aggregate a run; failed requests count only in `failed`/`failures` and concurrency."""
    if duration <= 0:
        raise ValueError(f"benchmark duration must be > 0 s, got {duration}")
    ok = [r for r in results if r.success]
    failures = Counter(r.error_reason or "unknown" for r in results if not r.success)
    inputs = sum(r.num_chunks for r in ok)
    tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    busy = sum(max(0.0, r.end - r.start) for r in results)
    return EmbedMetrics(
        duration=duration, completed=len(ok), failed=len(results) - len(ok),
        failures=dict(sorted(failures.items())), total_inputs=inputs, total_input_tokens=tokens,
        request_throughput=len(ok) / duration, input_throughput=inputs / duration,
        total_token_throughput=tokens / duration, max_concurrent_requests=peak_concurrency(results),
        mean_concurrency=busy / duration, mean_input_len=tokens / inputs if inputs else 0.0,
        e2el=Summary.of([r.latency for r in ok], percentiles))


# ---------------------------------------------------------------------------------------- server batches
def batch_sizes_over_run(before: server_wall.Samples | None, after: server_wall.Samples | None,
                         model: str) -> dict[str, Any]:
    """Difference of the server's batch-size histogram(s) over the run."""
    if before is None or after is None:
        return {"available": False, "why": "the server's /metrics could not be read"}
    names = sorted({n[: -len("_bucket")] for (n, _) in after if n.endswith("_bucket") and "batch_size" in n})
    if not names:
        return {"available": False, "why": "the server's /metrics exports no batch-size histogram "
                                           "(a histogram named *batch_size*); only the client's view is known"}
    name = names[0]

    def mine(labels: tuple[tuple[str, str], ...]) -> bool:
        d = dict(labels)
        return "model_name" not in d or d["model_name"] == model

    def total(suffix: str) -> float:
        return sum(v - before.get((n, lab), 0.0) for (n, lab), v in after.items()
                   if n == name + suffix and mine(lab))

    cumulative: dict[float, float] = {}
    for (n, lab), v in after.items():
        if n == name + "_bucket" and mine(lab):
            le = float(dict(lab)["le"])
            cumulative[le] = cumulative.get(le, 0.0) + v - before.get((n, lab), 0.0)
    buckets: dict[str, int] = {}
    prev = 0.0
    for le in sorted(cumulative):
        count = cumulative[le] - prev
        prev = cumulative[le]
        if count > 0:
            buckets["+Inf" if math.isinf(le) else f"{le:g}"] = round(count)
    batches, size_sum = total("_count"), total("_sum")
    return {"available": True, "metric": name, "batches": round(batches),
            "mean_batch_size": size_sum / batches if batches else None,
            "batch_size_le": buckets}  # upper bound of each histogram bucket -> batches in it


# ---------------------------------------------------------------------------------------- the run
def _specs(args: argparse.Namespace) -> tuple[list[RequestSpec], Any]:
    from stoker.bench.datasets import DatasetOptions, sample_requests
    from stoker.bench.tokenizer import load_tokenizer

    opts = DatasetOptions(spec=args.dataset, num_prompts=args.num_prompts, input_len=args.random_input_len,
                          output_len=1, range_ratio=args.random_range_ratio,
                          prefix_len=args.random_prefix_len, seed=args.seed)
    opts.validate()
    kind = getattr(args, "embedding_input", "text")
    if kind not in INPUT_KINDS:
        raise ValueError(f"--embedding-input must be one of {', '.join(INPUT_KINDS)}; got {kind!r}")
    if kind == "ids" and not args.tokenizer:
        raise ValueError("--embedding-input ids needs --tokenizer (the ids are the tokenizer's)")
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    specs = sample_requests(opts, tok)
    if kind == "ids":
        specs = [IdsSpec(s.prompt, len(ids), 1, tuple(ids)) for s in specs for ids in [tok.encode(s.prompt)]]
    return specs, tok


def run_embeddings(args: argparse.Namespace, *, label: str = "serve") -> dict[str, Any]:
    from stoker import __version__
    from stoker.bench.arrivals import validate_rate
    from stoker.bench.metrics import parse_percentiles
    from stoker.bench.progress import BenchProgress
    from stoker.bench.report import _num, args_record, command_line
    from stoker.bench.runner import (
        LoadConfig,
        api_root,
        auth_headers,
        fetch_models,
        first_model_id,
        run_load,
    )

    if args.goodput or args.hardware:
        raise ValueError("--goodput and --hardware are for generative endpoints, not --endpoint embeddings")
    per = getattr(args, "embedding_inputs_per_request", 1)
    if per < 1:
        raise ValueError(f"--embedding-inputs-per-request must be >= 1, got {per}")
    load = LoadConfig.from_args(args)
    load.validate()
    validate_rate(load.request_rate, load.burstiness)
    percentiles = parse_percentiles(args.percentiles)
    root = api_root(args.base_url)
    path = "/v1/embeddings" if args.endpoint == "embeddings" else args.endpoint
    specs, tok = _specs(args)
    models = asyncio.run(fetch_models(root, args.api_key))
    model = args.model or first_model_id(models)
    headers = auth_headers(args.api_key)
    endpoint = EmbedEndpoint(root + path, model, headers, per)
    progress = BenchProgress(total=len(specs), label=label, enabled=not args.disable_tqdm)
    before = server_wall.scrape(root, headers)
    outcome = asyncio.run(run_load(endpoint, specs, load, progress, send=send_embedding))  # type: ignore[arg-type]
    after = server_wall.scrape(root, headers)
    metrics = compute_embed_metrics(outcome.results, outcome.duration, percentiles=percentiles)
    results = outcome.results
    ok = [r for r in results if r.success]
    missing = sum(r.prompt_tokens is None for r in ok)
    notes = []
    if missing:
        notes.append(f"{missing} answers carried no usage.prompt_tokens; their input tokens are the dataset's "
                     + ("tokenizer counts" if tok else "estimates"))
    out: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "stoker_version": __version__,
        "command": command_line(args), "args": args_record(args), "label": label,
        "backend": "openai-embeddings", "base_url": root, "endpoint": path, "model_id": model, "models": models,
        "dataset": args.dataset, "tokenizer_id": args.tokenizer,
        "embedding_input": getattr(args, "embedding_input", "text"), "inputs_per_request": per,
        "percentiles": percentiles, "notes": notes,
        "input_tokens_source": "usage" if not missing else ("tokenizer" if tok else "estimate"),
        "request_rate": _num(load.request_rate), "burstiness": _num(load.burstiness),
        "max_concurrency": load.max_concurrency, "request_timeout": load.request_timeout, "seed": load.seed,
        "num_prompts": len(results),
    }
    out.update(metrics.as_dict())
    out.update({
        "input_lens": [r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in results],
        "num_inputs": [r.num_chunks for r in results],
        "e2els": [r.latency if r.success else None for r in results],
        "start_times": [r.start for r in results], "end_times": [r.end for r in results],
        "errors": [r.error for r in results], "error_reasons": [r.error_reason for r in results],
    })
    out["server_batch_sizes"] = batch_sizes_over_run(before, after, model)
    return out


def format_embed_report(result: dict[str, Any], percentiles: list[float]) -> str:
    from stoker.bench.report import WIDTH, report_head

    w = WIDTH
    lines, row = report_head("Embedding Benchmark Result", result)
    row("Total inputs:", result["total_inputs"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Input throughput (inputs/s):", result["input_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Mean concurrent requests:", result["mean_concurrency"])
    lines.append("End-to-end Latency".center(w, "-"))
    row("Mean E2EL (ms):", result.get("mean_e2el_ms"))
    row("Median E2EL (ms):", result.get("median_e2el_ms"))
    row("Std E2EL (ms):", result.get("std_e2el_ms"))
    for p in percentiles:
        key = percentile_key(p)
        row(f"{key.upper()} E2EL (ms):", result.get(f"{key}_e2el_ms"))
    lines.append("Server batch sizes".center(w, "-"))
    b = result.get("server_batch_sizes") or {}
    if b.get("available"):
        row("Batches formed:", b["batches"])
        row("Mean batch size:", b["mean_batch_size"])
        for le, n in b["batch_size_le"].items():
            row(f"  size <= {le}:", n)
    else:
        lines.append(f"server batch sizes: {b.get('why', 'not available')}")
    lines.append("=" * w)
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def cmd_serve_embeddings(args: argparse.Namespace) -> int:
    from stoker.bench.report import save_result

    result = run_embeddings(args)
    print(format_embed_report(result, result["percentiles"]))
    if args.save_result:
        print(f"saved {save_result(args.save_result, result)}")
    return 0 if result["completed"] > 0 else 1
