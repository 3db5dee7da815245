"""`stoker bench serve`: one load run against an OpenAI-compatible endpoint.

Also the building blocks `bench sweep` reuses: resolve the target, draw the prompts, run
one load configuration, and turn its results into the saved JSON.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

from stoker.bench import roofline_link
from stoker.bench.client import Endpoint, RequestSpec
from stoker.bench.datasets import DatasetOptions, sample_requests
from stoker.bench import server_wall
from stoker.bench.metrics import compute_metrics, parse_goodput, parse_percentiles
from stoker.bench.progress import BenchProgress
from stoker.bench.report import args_record, build_result, command_line, format_report, save_result
from stoker.bench.runner import (LoadConfig, RunOutcome, api_root, auth_headers, endpoint_path,
                                 fetch_models, first_model_id, run_load)
from stoker.bench.tokenizer import BenchTokenizer, load_tokenizer


@dataclass
class Prepared:
    """Everything fixed before load starts; shared by every run of a sweep."""

    endpoint: Endpoint
    models: dict[str, Any]
    specs: list[RequestSpec]
    tokenizer: BenchTokenizer | None
    percentiles: list[float]
    goodput: dict[str, float]
    roofline: roofline_link.RooflineRequest | None
    meta: dict[str, Any] = field(default_factory=dict)


def prepare(args: argparse.Namespace) -> Prepared:
    """Validate every flag and reach the server before any load is sent."""
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput)
    path, is_chat = endpoint_path(args.endpoint)
    root = api_root(args.base_url)
    opts = DatasetOptions(spec=args.dataset, num_prompts=args.num_prompts, input_len=args.random_input_len,
                          output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                          prefix_len=args.random_prefix_len, sharegpt_output_len=args.sharegpt_output_len,
                          seed=args.seed)
    opts.validate()
    roof = None
    if args.hardware:
        roof = roofline_link.RooflineRequest(args.hardware, args.model_config or args.model or "",
                                             args.tensor_parallel_size)
        if not roof.model_config:
            raise ValueError("--hardware needs the model's config: pass --model-config PRESET_OR_PATH")
        roofline_link.check(roof)
    models = asyncio.run(fetch_models(root, args.api_key))
    model = args.model or first_model_id(models)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    specs = sample_requests(opts, tokenizer)
    endpoint = Endpoint(url=root + path, model=model, chat=is_chat, headers=auth_headers(args.api_key),
                        ignore_eos=args.ignore_eos)
    meta = {
        "command": command_line(args),
        "args": args_record(args),
        "backend": "openai-chat" if is_chat else "openai-completions",
        "base_url": root,
        "endpoint": path,
        "model_id": model,
        "models": models,
        "dataset": args.dataset,
        "tokenizer_id": args.tokenizer,
        "ignore_eos": args.ignore_eos,
        "goodput_slo_ms": goodput or None,
        "percentiles": percentiles,
        "hardware": args.hardware,
    }
    return Prepared(endpoint, models, specs, tokenizer, percentiles, goodput, roof, meta)


def run_once(prep: Prepared, load: LoadConfig, *, label: str, show_progress: bool) -> dict[str, Any]:
    """One load configuration -> the result dict (metrics + per-request timings)."""
    progress = BenchProgress(total=len(prep.specs), label=label, enabled=show_progress)
    # The server's own wall counters before and after: its verdict on exactly this run's steps.
    root = prep.endpoint.url.rsplit("/v1/", 1)[0]
    wall_before = server_wall.scrape(root, prep.endpoint.headers)
    outcome: RunOutcome = asyncio.run(run_load(prep.endpoint, prep.specs, load, progress))
    wall_after = server_wall.scrape(root, prep.endpoint.headers)
    tok = prep.tokenizer
    metrics = compute_metrics(outcome.results, outcome.duration, percentiles=prep.percentiles,
                              goodput=prep.goodput or None, count_tokens=tok.count if tok else None)
    ok = [r for r in outcome.results if r.success]
    notes: list[str] = []
    missing_out = sum(r.output_tokens is None for r in ok)
    if missing_out and tok:
        out_src = "retokenized"
        notes.append(f"{missing_out} responses carried no usage.completion_tokens; output tokens "
                     f"re-counted by tokenizing the text with {tok.name}")
    elif missing_out:
        out_src = "chunks"
        notes.append(f"{missing_out} responses carried no usage.completion_tokens; output tokens "
                     "counted as content chunks (pass --tokenizer to re-tokenize the text)")
    else:
        out_src = "usage"
    missing_in = sum(r.prompt_tokens is None for r in ok)
    in_src = "usage" if not missing_in else ("tokenizer" if tok else "estimate")
    if missing_in and not tok:
        notes.append("input token counts are estimates (no usage.prompt_tokens, no --tokenizer)")
    meta = dict(prep.meta, label=label, output_tokens_source=out_src, input_tokens_source=in_src,
                notes=notes)
    result = build_result(metrics=metrics, outcome=outcome, load=load, meta=meta)
    result["server_wall"] = server_wall.wall_over_run(wall_before, wall_after)
    if prep.roofline is not None and metrics.completed:
        result["roofline"] = roofline_link.from_metrics(prep.roofline, result)
    return result


def cmd_serve(args: argparse.Namespace) -> int:
    from stoker.bench import embeddings

    if embeddings.is_embeddings(args.endpoint):
        return embeddings.cmd_serve_embeddings(args)
    load = LoadConfig.from_args(args)
    load.validate()
    from stoker.bench.arrivals import validate_rate

    validate_rate(load.request_rate, load.burstiness)
    prep = prepare(args)
    result = run_once(prep, load, label="serve", show_progress=not args.disable_tqdm)
    print(format_report(result, prep.percentiles))
    if args.save_result:
        path = save_result(args.save_result, result)
        print(f"saved {path}")
    # A run where nothing succeeded is a failed benchmark, whatever was measured.
    return 0 if result["completed"] > 0 else 1
