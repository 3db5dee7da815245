"""`stoker bench throughput`: offline throughput on random token prompts, ignore_eos.

Prints requests/s, output tokens/s and total (prompt + output) tokens/s, saying which is
which, and with --json one object whose throughput keys match `stoker bench serve`'s
(`request_throughput`, `output_throughput`, `total_token_throughput`) so `stoker roofline
--measured` reads either.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    from stoker.engine.args import add_engine_args

    p = bench_subparsers.add_parser("throughput", help="offline throughput of the engine on random prompts",
                                    description="Offline throughput: random token prompts, ignore_eos, all submitted at once.")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L x (1 - r), L x (1 + r)]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save-result", default=None, help="also write the JSON to this file")
    p.set_defaults(func=run)


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int,
                    avoid: tuple[int, ...] = ()) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; token ids uniform over the vocabulary minus `avoid`."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    rng = random.Random(seed)

    def length(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - range_ratio)), int(center * (1 + range_ratio))))

    allowed = [t for t in range(vocab_size) if t not in set(avoid)]
    return [([rng.choice(allowed) for _ in range(length(input_len))], length(output_len)) for _ in range(num_prompts)]


def measure(llm: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    from stoker import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_prompt = sum(len(ids) for ids, _ in requests)
    num_output = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "num_prompts": len(requests),
        "elapsed_s": elapsed,
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": num_output / elapsed,
        "total_token_throughput": (num_prompt + num_output) / elapsed,
    }


def run(args: argparse.Namespace) -> int:
    from stoker import LLM
    from stoker.engine.args import engine_kwargs

    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                               engine.hf_config["vocab_size"], args.seed, engine.eos_token_ids)
    result = measure(llm, requests)
    result.update(model=args.model, input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                  dtype=str(engine.executor.driver_runner.dtype).removeprefix("torch."), device=str(engine.executor.driver_runner.device))
    engine.check_integrity()
    if args.save_result:
        from pathlib import Path

        Path(args.save_result).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"Throughput ({result['num_prompts']} requests, {result['prompt_tokens']} prompt + "
              f"{result['output_tokens']} output tokens in {result['elapsed_s']:.2f} s):")
        print(f"  requests/s:                     {result['request_throughput']:.2f}")
        print(f"  output tokens/s:                {result['output_throughput']:.1f}   (generated tokens only)")
        print(f"  total tokens/s:                 {result['total_token_throughput']:.1f}   (prompt + generated)")
    return 0
