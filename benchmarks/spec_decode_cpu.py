"""Batch-1 decode with and without speculative decoding (n-gram, and a draft model), in the same
process, interleaved per round: output tokens/s, the speedup, and the acceptance the counters report.

    python benchmarks/spec_decode_cpu.py --rounds 3

Workload: edit-like prompts, each a random 48-token "file" written out four times with a few
tokens changed per copy (what a code-edit request looks like), one request at a time (batch 1),
greedy, ignore_eos. Model: the Llama-shaped random float32 checkpoint the CPU benchmarks share
(hidden 512, 8 layers, intermediate 1408, 8 heads / 4 KV heads, vocab 1024), or --model PATH.

A random-weight model does not copy its prompt as a trained one does, so acceptance cannot be
shown on one; the script measures the two ends instead, each against its own no-speculation peer:
  * "random": the checkpoint as made. Its greedy output does not repeat: drafts are proposed
    from the prompt's n-grams and (almost) never accepted; the ratio is what failed drafts cost.
  * "bigram": the same checkpoint with every o_proj and down_proj zeroed. Every layer is still
    computed (the same FLOPs and bytes per step), but nothing is added to the residual stream, so
    the next token is a function of the current one and the output falls into a cycle that the
    n-gram proposer then predicts: the ratio is what accepted drafts buy on this machine.
Both engines of a pair produce the same tokens (checked: lossless).

The draft model (`--draft`, on by default) is a 1-layer model of the same width for the 8-layer
target: "random" drafts with a random one (the cost of drafts that all fail); "bigram" drafts
with one carrying the target's embedding, final norm and LM head and its own layer's outputs
zeroed too, so it computes the target's bigram function in an eighth of the layers (drafts that
all pass: what a well-matched small draft buys).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model, isa  # noqa: E402
from stoker import LLM, SamplingParams  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

from benchmarks.tp_cpu import ISSUE2_SHAPE  # noqa: E402


def zero_layer_outputs(path: Path) -> None:
    """Zero every o_proj and down_proj in the checkpoint (the "bigram" variant)."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
        save_file(tensors, f, metadata={"format": "pt"})


def edit_like_prompts(num: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        file = [rng.randrange(5, 1000) for _ in range(48)]
        copies = []
        for _ in range(4):
            edited = list(file)
            for _ in range(3):
                edited[rng.randrange(len(edited))] = rng.randrange(5, 1000)
            copies += edited
        prompts.append({"prompt_token_ids": copies})
    return prompts


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Seconds to decode every prompt one at a time (batch 1), and their tokens."""
    llm.reset_prefix_cache()
    tokens = []
    start = time.perf_counter()
    for p in prompts:
        tokens.append(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def small_draft(target: Path, dest: Path, bigram: bool) -> Path:
    """A 1-layer draft of the target's width; for "bigram", with the target's embedding, final norm
    and LM head and its layer's outputs zeroed (the target's bigram function, 1 layer instead of 8)."""
    from safetensors.torch import load_file, save_file

    shape = {**ISSUE2_SHAPE, "num_hidden_layers": 1}
    make_tiny_checkpoint(dest, "llama", seed=1, **shape)
    if bigram:
        zero_layer_outputs(dest)
        (f,) = dest.glob("*.safetensors")
        (src,) = target.glob("*.safetensors")
        tensors, shared = load_file(f), load_file(src)
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors[name] = shared[name].clone()
        save_file(tensors, f, metadata={"format": "pt"})
    return dest


def measure(path: Path, k: int, prompts: list[dict], max_tokens: int, rounds: int, draft: Path | None = None) -> dict:
    """The engines on one checkpoint, rounds interleaved (the order alternates: drift hits all)."""
    common = dict(kv_cache_memory_bytes=1 << 28, max_model_len=1024, device="cpu", max_num_seqs=8)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    engines = {"none": LLM(str(path), **common), f"ngram k={k}": LLM(str(path), speculative_config=spec, **common)}
    if draft is not None:
        engines[f"draft_model k={k}"] = LLM(str(path), **common, speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": k})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels built, caches touched
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, outputs[name] = run(engines[name], prompts, params)
            times[name].append(seconds)
    stats = {n: engines[n].engine.stats().spec_decoding for n in names[1:]}
    for llm in engines.values():
        llm.shutdown()
    med = {n: statistics.median(v) for n, v in times.items()}
    num_tokens = len(prompts) * max_tokens
    none = names[0]
    return {n: {"times": times[n], "tokens_per_s": num_tokens / med[n], "none_tokens_per_s": num_tokens / med[none],
                "speedup": med[none] / med[n], "per_round": [a / b for a, b in zip(times[none], times[n])],
                # the least disturbed run of each: on a shared machine a burst of load only ever adds time
                "best_speedup": min(times[none]) / min(times[n]),
                "acceptance_rate": sd.acceptance_rate, "mean_acceptance_length": sd.mean_acceptance_length,
                "accepted_per_pos": sd.num_accepted_tokens_per_pos, "num_drafts": sd.num_drafts,
                "lossless": outputs[none] == outputs[n]}
            for n, sd in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--model", default=None, help="a checkpoint folder (instead of the two random variants)")
    ap.add_argument("--no-draft", action="store_true", help="leave out the draft_model rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp_dir = tempfile.TemporaryDirectory()  # removed at exit, also when a run fails
    if args.model:
        models = {"model": Path(args.model)}
    else:
        models = {"random": make_tiny_checkpoint(Path(tmp_dir.name) / "random", "llama", **ISSUE2_SHAPE),
                  "bigram": make_tiny_checkpoint(Path(tmp_dir.name) / "bigram", "llama", **ISSUE2_SHAPE)}
        zero_layer_outputs(models["bigram"])
    prompts = edit_like_prompts(args.num_prompts)
    drafts = {name: None if args.no_draft or args.model else
              small_draft(path, Path(tmp_dir.name) / f"draft-{name}", name == "bigram") for name, path in models.items()}
    results = {name: measure(path, args.k, prompts, args.max_tokens, args.rounds, drafts[name])
               for name, path in models.items()}
    print(f"# spec decode, batch 1: {cpu_model()} ({isa()}), {platform.machine()}, {args.num_prompts} prompts x "
          f"{args.max_tokens} tokens, k={args.k}, medians of {args.rounds} interleaved rounds")
    print("| model | method | none tokens/s | method tokens/s | method / none (medians) | fastest round each "
          "| per round | acceptance | mean acceptance length | lossless |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, by_method in results.items():
        for method, r in by_method.items():
            print(f"| {name} | {method} | {r['none_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x "
                  f"| {r['best_speedup']:.2f}x | {', '.join(f'{x:.2f}' for x in r['per_round'])} "
                  f"| {100 * r['acceptance_rate']:.1f}% | {r['mean_acceptance_length']:.2f} | {r['lossless']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
