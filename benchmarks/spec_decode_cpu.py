"""Speculative decoding on CPU, every engine in the same process, interleaved per round.

Batch 1 (default): decode with no speculation, n-gram and suffix drafts and a draft model (fixed k): output
tokens/s, the speedups, and the acceptance the counters report.

    python benchmarks/spec_decode_cpu.py --rounds 3

Concurrency sweep (--sweep 1,4,16,64): that many requests at once, with no speculation, a fixed
k and k chosen per step by the cost model ("dynamic": true, docs/spec_decode.md). The dynamic
engines price steps with this machine's device file (`stoker doctor --device cpu
--write-device-file`, $STOKER_DEVICE_FILE); without one the script measures one first (a few
seconds) into a temporary file. Each round runs the three engines back to back in a rotating
order, and each is compared with none's time of the same round: many short rounds, medians and
quartiles of the per-round ratios. Pin the process and its threads so rounds are comparable:

    stoker doctor --device cpu --write-device-file    # on the quiet machine, once
    OMP_NUM_THREADS=2 taskset -c 0,1 python benchmarks/spec_decode_cpu.py --sweep 1,4,16,64 \
        --sweep-models bigram --rounds 15 --max-tokens 16

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
import dataclasses
import json
import os
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
    common = dict(kv_cache_memory_bytes=1 << 28, max_model_len=1024, device="cpu")
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
            "dynamic": False}
    suffix = {"method": "suffix", "num_speculative_tokens": k, "dynamic": False}
    engines = {"none": LLM(str(path), **common), f"ngram k={k}": LLM(str(path), speculative_config=spec, **common),
               f"suffix k={k}": LLM(str(path), speculative_config=suffix, **common)}
    if draft is not None:
        engines[f"draft_model k={k}"] = LLM(str(path), **common, speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "dynamic": False})
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
    sds = {n: engines[n].engine.stats().spec_decoding for n in names[1:]}
    for llm in engines.values():
        llm.shutdown()
    med = {n: statistics.median(v) for n, v in times.items()}
    num_tokens = len(prompts) * max_tokens
    return {"times": times, "tokens_per_s": {n: num_tokens / v for n, v in med.items()},
            "speedup": {n: med[names[0]] / med[n] for n in names[1:]},
            "per_round": {n: [a / b for a, b in zip(times[names[0]], times[n])] for n in names[1:]},
            # the least disturbed run of each: on a shared machine a burst of load only ever adds time
            "best_speedup": {n: min(times[names[0]]) / min(times[n]) for n in names[1:]},
            "acceptance_rate": {n: sd.acceptance_rate for n, sd in sds.items()},
            "mean_acceptance_length": {n: sd.mean_acceptance_length for n, sd in sds.items()},
            "num_drafts": {n: sd.num_drafts for n, sd in sds.items()},
            "lossless": all(outputs[n] == outputs[names[0]] for n in names[1:])}


def sweep_prompts(num: int, seed: int = 1) -> list[dict]:
    """Shorter edit-like prompts for the sweep (a 16-token "file" four times, 64 tokens), so that
    64 prompts' prefill does not drown the decode being compared."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        file = [rng.randrange(5, 1000) for _ in range(16)]
        copies = []
        for _ in range(4):
            edited = list(file)
            edited[rng.randrange(len(edited))] = rng.randrange(5, 1000)
            copies += edited
        out.append({"prompt_token_ids": copies})
    return out


def ensure_device_file(tmp: Path) -> str:
    """This machine's roofs for the dynamic engines: $STOKER_DEVICE_FILE or the default path if
    either exists, else measured now (what `stoker doctor --write-device-file` does) into `tmp`."""
    import os

    from stoker.roofline import device_file

    path = device_file.default_path()
    if path.exists():
        return str(path)
    from stoker.doctor.device import measure_device

    # Best of three: on a shared machine load only ever lowers a measured rate
    runs = [measure_device(read_mib=256, gemm_sizes=(512, 1024), iters=10) for _ in range(3)]
    dev = dataclasses.replace(runs[0], fp32_tflops=max(r.fp32_tflops for r in runs),
                              bf16_tflops=max(r.bf16_tflops for r in runs),
                              read_gb_per_s=max(r.read_gb_per_s for r in runs))
    out = device_file.write_device_file(dev, tmp / "this-device.yaml")  # removed with the run's temp folder
    os.environ[device_file.ENV_VAR] = str(out)
    return f"{out} (measured now: {dev.fp32_tflops * 1e3:.0f} GFLOP/s fp32, {dev.read_gb_per_s:.1f} GB/s)"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); all three the value itself for one value."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def measure_sweep(path: Path, k: int, concurrencies: list[int], max_tokens: int, rounds: int) -> dict:
    """none / fixed k / dynamic k (ngram drafts) at each concurrency: all requests at once.

    Made to survive a shared machine: a round runs the three engines back to back on the same
    requests, the order rotating from round to round (each engine goes first, second and third
    equally often), and each engine's time is compared with none's of the same round (a paired
    ratio: a burst of load that spans a round hits both sides). Many short rounds, then medians
    and quartiles of those per-round ratios; the load average is recorded around each concurrency."""
    common = dict(kv_cache_memory_bytes=1 << 28, max_model_len=512, device="cpu", max_num_seqs=max(concurrencies))
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    engines = {"none": LLM(str(path), **common),
               f"fixed k={k}": LLM(str(path), speculative_config={**ngram, "dynamic": False}, **common),
               "dynamic": LLM(str(path), speculative_config=ngram, **common)}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = sweep_prompts(max(concurrencies))
    for llm in engines.values():
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    names = list(engines)
    policy = engines["dynamic"].engine.spec_k_policy
    rows = {}
    for c in concurrencies:
        times: dict[str, list[float]] = {n: [] for n in names}
        outputs: dict[str, list[list[int]]] = {}
        ks_before = dict(policy.steps_at_k)
        drafted_before = {n: engines[n].engine.stats().spec_decoding.num_draft_tokens for n in names[1:]}
        load_before = os.getloadavg()[0]
        for r in range(rounds):
            for name in names[r % 3:] + names[: r % 3]:
                llm = engines[name]
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outs = llm.generate(prompts[:c], params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
                outputs[name] = [o.outputs[0].token_ids for o in outs]
        med = {n: statistics.median(v) for n, v in times.items()}
        per_round = {n: [a / b for a, b in zip(times["none"], times[n])] for n in names[1:]}
        ks = {kk: n - ks_before.get(kk, 0) for kk, n in policy.steps_at_k.items() if n - ks_before.get(kk, 0)}
        rows[c] = {"tokens_per_s": {n: c * max_tokens / v for n, v in med.items()},
                   "times": times,
                   # per-round ratios to none's round: (Q1, median, Q3), and the rounds at least as fast
                   "ratio": {n: quartiles(v) for n, v in per_round.items()},
                   "rounds_not_slower": {n: sum(x >= 1.0 for x in v) for n, v in per_round.items()},
                   "dynamic_over_fixed": quartiles([a / b for a, b in zip(times[names[1]], times["dynamic"])]),
                   "dynamic_k_steps": dict(sorted(ks.items())),
                   # draft tokens verified (0 for both: nothing was proposed, the engines ran none's steps)
                   "draft_tokens": {n: engines[n].engine.stats().spec_decoding.num_draft_tokens - drafted_before[n]
                                    for n in names[1:]},
                   "load_average": (load_before, os.getloadavg()[0]),
                   "lossless": all(outputs[n] == outputs["none"] for n in names[1:])}
    for llm in engines.values():
        llm.shutdown()
    return rows


def pinning() -> str:
    """The CPUs this process may run on and its thread count: what the sweep's figures depend on."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return f"CPUs {','.join(map(str, cpus)) or '?'} of {os.cpu_count()}, OMP_NUM_THREADS={threads}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--model", default=None, help="a checkpoint folder (instead of the two random variants)")
    ap.add_argument("--no-draft", action="store_true", help="leave out the draft_model rows")
    ap.add_argument("--sweep", default=None, help="concurrencies, e.g. 1,4,16,64: the fixed-k / dynamic-k sweep")
    ap.add_argument("--sweep-models", default="random,bigram", help="which of the variants the sweep runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp_dir = tempfile.TemporaryDirectory()  # removed at exit, also when a run fails
    if args.model:
        models = {"model": Path(args.model)}
    else:
        models = {"random": make_tiny_checkpoint(Path(tmp_dir.name) / "random", "llama", **ISSUE2_SHAPE),
                  "bigram": make_tiny_checkpoint(Path(tmp_dir.name) / "bigram", "llama", **ISSUE2_SHAPE)}
        zero_layer_outputs(models["bigram"])
    if args.sweep:
        concurrencies = [int(c) for c in args.sweep.split(",")]
        where = ensure_device_file(Path(tmp_dir.name))
        chosen = models if args.model else {n: models[n] for n in args.sweep_models.split(",")}
        sweep = {name: measure_sweep(path, args.k, concurrencies, args.max_tokens, args.rounds)
                 for name, path in chosen.items()}
        print(f"# spec decode sweep: {cpu_model()} ({isa()}), {platform.machine()}, {pinning()}, {args.max_tokens} "
              f"tokens per request, k={args.k} (ngram drafts), {args.rounds} rounds per concurrency, the three "
              f"engines back to back in a rotating order; device file {where}")
        print("| model | concurrency | none tok/s | fixed k tok/s | dynamic tok/s | fixed / none, per round: median "
              "(Q1-Q3) | dynamic / none, per round: median (Q1-Q3) | rounds dynamic >= none | dynamic / fixed, "
              "median | draft tokens verified: fixed, dynamic | dynamic: steps per k | load average | lossless |")
        print("|---|---:|---:|---:|---:|---|---|---:|---:|---|---|---|---|")
        for name, rows in sweep.items():
            for c, r in rows.items():
                none, fixed, dyn = r["tokens_per_s"].values()
                (fq1, fm, fq3), (dq1, dm, dq3) = r["ratio"].values()
                ks = ", ".join(f"k={k}: {n}" for k, n in r["dynamic_k_steps"].items())
                load = "-".join(f"{x:.1f}" for x in r["load_average"])
                print(f"| {name} | {c} | {none:.1f} | {fixed:.1f} | {dyn:.1f} | {fm:.2f}x ({fq1:.2f}-{fq3:.2f}) "
                      f"| {dm:.2f}x ({dq1:.2f}-{dq3:.2f}) | {r['rounds_not_slower']['dynamic']}/{args.rounds} "
                      f"| {r['dynamic_over_fixed'][1]:.2f}x | {', '.join(map(str, r['draft_tokens'].values()))} "
                      f"| {ks} | {load} | {r['lossless']} |")
        if args.json:
            Path(args.json).write_text(json.dumps(sweep, indent=2, default=str))
        return
    prompts = edit_like_prompts(args.num_prompts)
    drafts = {name: None if args.no_draft or args.model else
              small_draft(path, Path(tmp_dir.name) / f"draft-{name}", name == "bigram") for name, path in models.items()}
    results = {name: measure(path, args.k, prompts, args.max_tokens, args.rounds, drafts[name])
               for name, path in models.items()}
    print(f"# spec decode, batch 1: {cpu_model()} ({isa()}), {platform.machine()}, {args.num_prompts} prompts x "
          f"{args.max_tokens} tokens, k={args.k} (fixed), medians of {args.rounds} interleaved rounds")
    print("| model | engine | tokens/s | / none (medians) | fastest round each | per round | acceptance "
          "| mean acceptance length | lossless |")
    print("|---|---|---:|---:|---:|---|---:|---:|---|")
    for name, r in results.items():
        tps = r["tokens_per_s"]
        first = next(iter(tps))
        print(f"| {name} | {first} | {tps[first]:.1f} | | | | | | |")
        for n in list(tps)[1:]:
            print(f"| {name} | {n} | {tps[n]:.1f} | {r['speedup'][n]:.2f}x | {r['best_speedup'][n]:.2f}x "
                  f"| {', '.join(f'{x:.2f}' for x in r['per_round'][n])} "
                  f"| {100 * r['acceptance_rate'][n]:.1f}% | {r['mean_acceptance_length'][n]:.2f} | {r['lossless']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
