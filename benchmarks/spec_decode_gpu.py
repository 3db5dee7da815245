"""Speculative decoding at batch 1 on a GPU: no speculation, n-gram (prompt lookup) and a draft
model, on a Llama-3-8B-shaped random bf16 checkpoint, one request at a time.

    python3 benchmarks/spec_decode_gpu.py --checkpoint CKPT       # what gpu_check.sh passes (HF layout)
    python3 benchmarks/spec_decode_gpu.py --checkpoint CKPT --json spec_decode_gpu.json
    python3 benchmarks/spec_decode_gpu.py --smoke                 # a tiny random checkpoint on CPU:
                                                                  # exercises the script, times nothing useful

Workload: --num-prompts (1) requests, each the first 128 tokens of benchmarks/spec_decode_cpu.py's
edit-like prompts (a 48-token "file" and its edited copies: what prompt lookup is for), 256 output
tokens, greedy, ignore_eos, one request at a time (max_num_seqs 1, KV 1 GiB). Engines, built one
after the other (each shut down and its memory freed before the next starts), fixed k = --k (4):
  none             no speculation (decode replays a CUDA graph);
  ngram k=4        prompt lookup, n from 4 down to 1 (spec_decode_cpu.py's settings);
  draft_model k=4  a 1-layer Llama of the target's width and vocabulary (a quarter of its
                   intermediate size), random, written on the fly.
Each engine gets one 32-token warm-up request, then the prompts; output tokens/s is all the
prompts' output tokens over their wall time (prefill included, the same for every engine).

Random weights: a random model's greedy output repeats only by chance, so the acceptance is
whatever the drafts happen to match; the figures are the mechanism's cost or benefit at that
acceptance, not a trained model's. Two variants bracket it, as in spec_decode_cpu.py:
  random  the checkpoint as written (n-gram drafts found in the prompt are mostly rejected, the
          random draft model's almost always);
  bigram  the same engines with every o_proj and down_proj zeroed in place after the random runs
          (the KV cache's prefixes dropped): every layer still runs (the same bytes and FLOPs per
          step), but the next token is a function of the current one, so the output falls into a
          cycle the n-gram proposer predicts; the draft gets the target's embedding, final norm and
          LM head and its own layer's outputs zeroed, so it computes the same function and its
          drafts pass. What accepted drafts buy on this GPU.
Every engine's tokens are compared with none's (lossless). Acceptance: the engine's counters
(stats().spec_decoding) over the timed requests. Steps (benchmarks/step_overhead.py's StepTimer:
host wall time per engine step, the target forward's GPU time by CUDA events, "other" = the
runner's time outside prepare/forward/logits: sampling, the rejection sampler and the draft
model's forwards):
medians over plain decode steps (one token) and verify steps (one token + drafts; these run
eagerly, a graph holds one token per sequence). Budget: under 90 s on an H100, start-ups included.
Without CUDA (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_figures import write_checkpoint  # noqa: E402
from step_overhead import StepTimer  # noqa: E402

from benchmarks.spec_decode_cpu import edit_like_prompts  # noqa: E402
from stoker import LLM, SamplingParams  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

VARIANTS = ("random", "bigram")


def write_draft(cfg: dict[str, Any], dest: Path, dtype: str) -> Path:
    """A random 1-layer Llama of the target's width, heads, vocabulary and positions."""
    keep = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
            "rope_parameters", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
    shape = {k: cfg[k] for k in keep if cfg.get(k) is not None}
    return make_tiny_checkpoint(dest, "llama", seed=1, dtype=dtype, num_hidden_layers=1,
                                intermediate_size=max(cfg["intermediate_size"] // 4, 16), **shape)


@torch.inference_mode()
def zero_layer_outputs(model: nn.Module) -> int:
    """Zero every o_proj and down_proj weight in place (the "bigram" variant); how many modules."""
    count = 0
    for name, module in model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                t.zero_()
            count += 1
    return count


@torch.inference_mode()
def share_outer_weights(draft: nn.Module, target: nn.Module) -> list[str]:
    """Copy the target's parameters outside its layers (embedding, final norm, LM head) into the
    draft's of the same name, in place; their names."""
    target_params = dict(target.named_parameters())
    copied = []
    for name, p in draft.named_parameters():
        if ".layers." in name:
            continue
        src = target_params.get(name)
        if src is None or src.shape != p.shape:
            raise ValueError(f"draft parameter {name} {tuple(p.shape)} has no twin in the target")
        p.copy_(src)
        copied.append(name)
    return copied


def make_bigram(llm: LLM) -> None:
    runner = llm.engine.executor.driver_runner
    zero_layer_outputs(runner.model)
    drafter = runner.drafter
    if drafter is not None:
        share_outer_weights(drafter.model, runner.model)
        zero_layer_outputs(drafter.model)
    llm.reset_prefix_cache()  # blocks computed by the other weights must not be hit


def step_kind(plan: Any) -> str:
    if not plan.scheduled:
        return "empty"
    s = plan.scheduled[0]  # batch 1
    if s.num_draft_tokens:
        return "verify"
    return "decode" if s.num_tokens == 1 else "prefill"


def timed_request(llm: LLM, timer: StepTimer, req_id: str, prompt: list[int],
                  params: SamplingParams) -> tuple[float, list[int], list[tuple[str, dict[str, float]]]]:
    """One request alone, stepped through `timer`: (seconds, its tokens, (kind, phase ms) per step)."""
    engine = llm.engine
    kinds: list[str] = []
    finished: list[Any] = []
    schedule, step = engine.scheduler.schedule, engine.step

    def classified() -> Any:
        plan = schedule()
        kinds.append(step_kind(plan))
        return plan

    def stepped() -> Any:
        outs = step()
        finished.extend(o for o in outs if o.finished)
        return outs

    engine.scheduler.schedule, engine.step = classified, stepped
    steps = []
    try:
        start = time.perf_counter()
        engine.add_request(engine.input_processor.process(req_id, None, params, prompt))
        while engine.has_unfinished_requests():
            before = len(kinds)
            times, _ = timer.step()
            steps.append((kinds[before] if len(kinds) > before else "empty", times))
        seconds = time.perf_counter() - start
    finally:
        engine.scheduler.schedule, engine.step = schedule, step
    (out,) = finished
    return seconds, list(out.outputs[0].token_ids), steps


def counters(llm: LLM) -> tuple[int, int, int]:
    sd = llm.engine.stats().spec_decoding
    return (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens) if sd is not None else (0, 0, 0)


def summarize(steps: list[tuple[str, dict[str, float]]], kind: str) -> dict[str, Any]:
    rows = [t for k, t in steps if k == kind]
    if not rows:
        return {"steps": 0}
    med = {p: statistics.median(t.get(p, 0.0) for t in rows) for p in ("step", "forward", "forward_gpu", "runner_other")}
    return {"steps": len(rows), **{f"{p}_ms": v for p, v in med.items()}}


def run_engine(name: str, llm: LLM, variants: list[str], prompts: dict[str, list[list[int]]], warm: list[int],
               max_tokens: int, warm_tokens: int) -> dict[str, Any]:
    """Every variant on one engine (random first: bigram zeroes weights in place)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runner = llm.engine.executor.driver_runner
    sampler = runner.sampler
    timer = StepTimer(llm)
    # the timer replaces the sampler by a timed function; verification calls the sampler's methods
    # (sampler.prepare), so it stays itself and sampling counts in "other"
    runner.sampler = sampler
    out: dict[str, Any] = {}
    try:
        for variant in variants:
            try:
                out[variant] = run_variant(name, llm, timer, variant, prompts[variant], warm, params, warm_tokens)
            except Exception:  # the variants already measured are kept; this engine stops here
                traceback.print_exc()
                out["failed_variant"] = variant
                break
    finally:
        timer.close()
    return out


def run_variant(name: str, llm: LLM, timer: StepTimer, variant: str, prompts: list[list[int]], warm: list[int],
                params: SamplingParams, warm_tokens: int) -> dict[str, Any]:
    """One variant's warm-up and timed requests on one engine."""
    if variant == "bigram":
        make_bigram(llm)
    timed_request(llm, timer, f"{name}-{variant}-warm", warm,
                  SamplingParams(temperature=0, max_tokens=warm_tokens, ignore_eos=True))
    before = counters(llm)
    seconds, tokens, steps = 0.0, [], []
    for i, prompt in enumerate(prompts):
        s, t, st = timed_request(llm, timer, f"{name}-{variant}-{i}", prompt, params)
        seconds, tokens, steps = seconds + s, tokens + [t], steps + st
    drafts, draft_tokens, accepted = (a - b for a, b in zip(counters(llm), before))
    result = {"seconds": seconds, "output_tokens": sum(map(len, tokens)),
              "tokens_per_s": sum(map(len, tokens)) / seconds, "tokens": tokens,
              "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
              "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
              "mean_accepted_per_verify": accepted / drafts if drafts else None,
              "decode_steps": summarize(steps, "decode"), "verify_steps": summarize(steps, "verify")}
    print(f"# {name}, {variant}: {result['tokens_per_s']:.1f} tok/s, {drafts} verify steps, "
          f"{accepted} of {draft_tokens} draft tokens accepted", flush=True)
    return result


def free_memory(device: torch.device) -> None:
    """After the caller dropped its last reference to an engine: its weights, KV cache and graphs
    go back to the device (engines never coexist)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"# device memory allocated after freeing the engine: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="an HF-layout checkpoint (default: a Llama-3-8B-shaped one written "
                                         "first, minutes; --smoke: a tiny one)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (fixed)")
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="random, bigram or both (module doc)")
    ap.add_argument("--no-draft", action="store_true", help="leave out the draft_model engine")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks/spec_decode_gpu.py needs a CUDA GPU (none is visible to torch); nothing was measured. "
              "--smoke runs the script on CPU with a tiny checkpoint.")
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants {unknown}: choose from {', '.join(VARIANTS)}")
    variants = [v for v in VARIANTS if v in variants]  # random before bigram: bigram zeroes weights in place
    device = torch.device("cpu" if args.smoke else "cuda")
    num_prompts, max_tokens = (1, 16) if args.smoke else (args.num_prompts, args.max_tokens)
    # the prompts (first input_len tokens of the edit-like ones), a different set per variant, and a warm-up
    prompts = {v: [p["prompt_token_ids"][: args.input_len] for p in edit_like_prompts(num_prompts, seed=10 + i)]
               for i, v in enumerate(VARIANTS)}
    warm = edit_like_prompts(1, seed=99)[0]["prompt_token_ids"][: args.input_len]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
                              "torch": torch.__version__, "k": args.k, "num_prompts": num_prompts,
                              "input_len": args.input_len, "max_tokens": max_tokens, "engines": {}}
    failed = []

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.checkpoint:
            ckpt = Path(args.checkpoint)
        elif args.smoke:
            ckpt = make_tiny_checkpoint(root / "tiny", "llama")
        else:
            ckpt = write_checkpoint(root / "ckpt", "llama3-8b", device, torch.bfloat16)
        cfg = json.loads((ckpt / "config.json").read_text())
        result["checkpoint"] = str(ckpt)
        engines: dict[str, dict[str, Any] | None] = {
            "none": None,
            f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 1, "dynamic": False}}
        if not args.no_draft:
            t0 = time.perf_counter()
            draft = write_draft(cfg, root / "draft", "bfloat16" if device.type == "cuda" else "float32")
            result["draft_write_s"] = time.perf_counter() - t0
            engines[f"draft_model k={args.k}"] = {"method": "draft_model", "model": str(draft),
                                                  "num_speculative_tokens": args.k, "dynamic": False}
        common = dict(device=device.type, max_model_len=args.input_len + max_tokens + args.k + 16, max_num_seqs=1,
                      kv_cache_memory_bytes=(1 << 30) if device.type == "cuda" else (64 << 20))
        for name, spec in engines.items():
            try:
                t0 = time.perf_counter()
                llm = LLM(str(ckpt), speculative_config=spec, **common)
                start_s = time.perf_counter() - t0
                graphs = llm.engine.executor.driver_runner.graph_runner is not None
                freed = weakref.ref(llm.engine)
                try:
                    runs = run_engine(name, llm, variants, prompts, warm, max_tokens, 8 if args.smoke else 32)
                finally:
                    llm.shutdown()
                    del llm  # the last reference: shutdown() alone frees nothing
                    free_memory(device)
                result["engines"][name] = {"start_s": start_s, "cuda_graphs": graphs, "freed": freed() is None, **runs}
                if "failed_variant" in runs:
                    failed.append(f"{name} ({runs['failed_variant']})")
            except Exception:  # the other engines still run: one failure must not cost every figure
                traceback.print_exc()
                failed.append(name)
            free_memory(device)
            save()
    finalize(result)
    print_table(result, args.smoke)
    result["failed"] = failed
    save()
    return 1 if failed else 0


def finalize(result: dict[str, Any]) -> None:
    """Speedups and losslessness against none, per variant."""
    none = result["engines"].get("none", {})
    for name, runs in result["engines"].items():
        for variant in VARIANTS:
            r, ref = runs.get(variant), none.get(variant)
            if r is None or ref is None:
                continue
            r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["lossless"] = r["tokens"] == ref["tokens"]


def print_table(result: dict[str, Any], smoke: bool) -> None:
    print(f"\n# speculative decoding, batch 1, {result['device']}: {result['num_prompts']} prompts x "
          f"{result['input_len']} -> {result['max_tokens']} tokens, greedy, k={result['k']} fixed; {result['checkpoint']}")
    print("| model | engine | tok/s | / none | acceptance | accepted per verify | lossless | decode steps: n, step ms, "
          "fwd GPU ms | verify steps: n, step ms, fwd GPU ms, other ms | start s |")
    print("|---|---|---:|---:|---:|---:|---|---|---|---:|")
    for variant in VARIANTS:
        for name, runs in result["engines"].items():
            r = runs.get(variant)
            if r is None:
                continue
            d, v = r["decode_steps"], r["verify_steps"]
            dec = f"{d['steps']}, {d['step_ms']:.2f}, {d['forward_gpu_ms']:.2f}" if d["steps"] else "0"
            ver = (f"{v['steps']}, {v['step_ms']:.2f}, {v['forward_gpu_ms']:.2f}, {v['runner_other_ms']:.2f}"
                   if v["steps"] else "0")
            acc = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f}%"
            per = "-" if r["mean_accepted_per_verify"] is None else f"{r['mean_accepted_per_verify']:.2f}"
            print(f"| {variant} | {name} | {r['tokens_per_s']:.1f} | {r.get('speedup', float('nan')):.2f}x | {acc} | "
                  f"{per} | {r.get('lossless', '-')} | {dec} | {ver} | {runs['start_s']:.1f} |")
    if smoke:
        print("(smoke: a tiny model on CPU: the times mean nothing)")


if __name__ == "__main__":
    sys.exit(main())
