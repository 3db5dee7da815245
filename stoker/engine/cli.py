"""`stoker generate --model DIR --prompt "..." [sampling flags]`."""

from __future__ import annotations

import argparse
import json
import sys

from stoker.engine.args import add_engine_args, engine_kwargs


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text offline from a checkpoint", description="Generate text offline (no server).")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message through the chat template")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--n", type=int, default=1)
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible output)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stoker import LLM, SamplingParams

    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, stop=args.stop,
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outs):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "outputs": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                             "cumulative_logprob": c.cumulative_logprob} for c in out.outputs],
            }))
        else:
            for c in out.outputs:
                print(f"--- prompt: {prompt!r} [{c.index}] ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
                print(c.text)
    sys.stdout.flush()
    return 0
