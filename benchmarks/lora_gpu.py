"""Multi-LoRA on a GPU: the BGMV kernel's cost on one layer's projections, and offline throughput
with 4 rank-16 adapters beside the base model, on a Llama-3-8B-shaped random bf16 checkpoint.

    python3 benchmarks/lora_gpu.py --checkpoint CKPT            # what gpu_check.sh passes (HF layout)
    python3 benchmarks/lora_gpu.py --checkpoint CKPT --json lora_gpu.json
    python3 benchmarks/lora_gpu.py --smoke                      # a tiny random checkpoint on CPU,
                                                                # the kernel under the Triton interpreter:
                                                                # exercises the script, times nothing useful

Adapters: 4 random rank-16 PEFT folders (adapter_config.json + adapter_model.safetensors, lora_alpha
32, targets q, k, v, o, gate, up, down in every layer), their A (r, in) and B (out, r) drawn on the
device with torch (std 0.02) from the checkpoint config's shapes, written to a temporary folder.

(a) Kernel: one layer's projections as the decode step runs them, qkv (4096 -> 6144, 3 shards),
o (4096 -> 4096), gate_up (4096 -> 28672, 2 shards), down (14336 -> 4096), at B = 1, 32, 256
tokens spread over the 4 adapters in contiguous runs (the step orders its sequences by slot;
B = 1 uses one adapter). "base": F.linear of the bf16 weight. "lora": the same F.linear, then
`LoRASlots._apply_bgmv` (layers/lora.py: the Triton BGMV kernel, kernels/lora_bgmv.py, once per
shard) over slots filled from the written adapters by the engine's own loader. Two timings,
medians of CUDA-event-timed runs: "device", the calls replayed from a CUDA graph (5 calls per
replay, 5 replays: the kernels' own time, no launch gaps; a projection alone can keep part of its
weight in the 50 MB L2, the whole layer's 436 MB cannot); "eager", one call launched from Python
with the GPU idle before it (10 runs; what the engine pays today: it runs LoRA steps eagerly,
runner/model_runner.py).
Each lora output is first checked against the float32 twin (reference.lora_segments): the
error is relative to the update's own norm, so a skipped update reads 1.0.

(b) Engine: offline LLM.generate, 256 requests of 128 random prompt tokens -> 128 output tokens
(greedy, ignore_eos, max_num_seqs 256, max_num_batched_tokens 8192, KV 10 GiB):
  base       LoRA off (CUDA graphs on for decode);
  lora-off   --enable-lora --max-loras 4, no request on an adapter (LoRA engines decode eagerly);
  lora-4     the same engine, request i on adapter i % 4.
Output tokens/s; each engine first runs the whole batch for 4 tokens (the kernels' variants for
these shapes compiled) and the LoRA engine one request per adapter (the adapters read in). The two engines never
coexist: the first is shut down and its memory freed before the second starts (weights
~15 GiB, KV sized explicitly, so gpu_memory_utilization plays no part). If the kernel timings
predict that lora-4's extra kernel time (32 layers x the per-token layer cost at B = 256 x the
workload's 256 x 256 tokens) exceeds --max-lora-extra-s (15), the request count is halved for
all three runs until it fits (a line says so; the table gives the count). Budget: under 90 s on an H100, start-ups included.
Without CUDA (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_figures import random_prompts, timed_ms, write_checkpoint  # noqa: E402

from stoker import LLM, LoRARequest, SamplingParams  # noqa: E402
from stoker.kernels import reference  # noqa: E402
from stoker.layers.lora import LoRAMapping, LoRASlots, segments_of  # noqa: E402
from stoker.lora.adapter import TARGETS, _shape, load_adapter  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

NUM_ADAPTERS = 4
# (slots' module name, its PEFT shards): the layer's projections in the order the decode step runs them
PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def write_adapters(cfg: dict[str, Any], root: Path, num: int, rank: int, device: torch.device) -> list[Path]:
    """`num` random PEFT LoRA folders for the model of `cfg`: A (r, in) and B (out, r) of every
    target projection of every layer, std 0.02, in the checkpoint's dtype."""
    from safetensors.torch import save_file

    dtype = getattr(torch, cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    paths = []
    for i in range(num):
        gen = torch.Generator(device=device).manual_seed(100 + i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module in TARGETS:
                fan_in, fan_out = _shape(cfg, module)
                block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                for which, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
                    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
                    tensors[f"{key}.lora_{which}.weight"] = t.to(dtype).cpu()
        folder = root / f"adapter{i}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(TARGETS), "lora_dropout": 0.0}))
        paths.append(folder)
    return paths


def graph_ms(fn: Callable[[], object], device: torch.device, calls: int = 5) -> float:
    """Median ms per call of `calls` calls replayed from one CUDA graph (kernels only); on CPU the
    eager timing (smoke mode). NaN, with the error printed, if the calls cannot be captured."""
    if device.type != "cuda":
        return timed_ms(fn, device, reps=1, warmup=0)
    try:
        return _graph_ms(fn, device, calls)
    except Exception:  # the eager column and the engine part still run
        traceback.print_exc()
        torch.cuda.synchronize(device)
        return float("nan")


def _graph_ms(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm: every kernel compiled before the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = timed_ms(graph.replay, device, reps=5, warmup=1) / calls
    del graph
    return ms


def eager_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of one call launched with the GPU idle before it (CUDA events); fewer runs on CPU."""
    return timed_ms(fn, device, reps=10, warmup=2) if device.type == "cuda" else timed_ms(fn, device, reps=1, warmup=0)


def kernel_level(cfg: dict[str, Any], adapters: list[Path], rank: int, batch_sizes: list[int],
                 device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Per batch size, per projection and for the whole layer: base vs base + LoRA (module doc, (a))."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    gen = torch.Generator(device=device).manual_seed(0)
    loaded = [load_adapter(f"adapter{i}", p, cfg, rank) for i, p in enumerate(adapters)]
    weights, slots = {}, {}
    for name, shards in PROJECTIONS.items():
        sizes = [_shape(cfg, s) for s in shards]
        fan_in, fan_out = sizes[0][0], sum(o for _, o in sizes)
        weights[name] = torch.randn(fan_out, fan_in, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
        firsts = [sum(o for _, o in sizes[:k]) for k in range(len(sizes))]
        slots[name] = LoRASlots(0, [(s, first, o, slice(None)) for s, first, (_, o) in zip(shards, firsts, sizes)],
                                fan_in, fan_out, NUM_ADAPTERS, rank, dtype, device)
        for slot, adapter in enumerate(loaded):
            slots[name].load(slot, adapter)
    rows = []
    for b in batch_sizes:
        slot_per_token = [t * min(b, NUM_ADAPTERS) // b for t in range(b)]  # contiguous runs, as a step orders them
        mapping = LoRAMapping(segments_of(slot_per_token, list(range(b + 1))),
                              torch.tensor(slot_per_token, dtype=torch.int32, device=device))
        xs = {name: torch.randn(b, inter if name == "down_proj" else hidden, generator=gen, device=device,
                                dtype=torch.float32).to(dtype) for name in PROJECTIONS}

        def base(names: list[str]) -> Callable[[], object]:
            return lambda: [F.linear(xs[n], weights[n]) for n in names]

        def lora(names: list[str]) -> Callable[[], object]:
            # what LoRAMethod._apply_after runs on a GPU: the base GEMM, then the slots' BGMV update
            # (called directly so the CPU dry run goes through the same Triton kernel)
            return lambda: [slots[n]._apply_bgmv(xs[n], F.linear(xs[n], weights[n]), mapping.slot_ids) for n in names]

        for name in PROJECTIONS:  # the update against its float32 twin, before any timing
            got = lora([name])()[0].float()
            base_out = F.linear(xs[name], weights[name]).float()
            want = reference.lora_segments(xs[name].float(), slots[name].A.float(), slots[name].BT.float(),
                                           mapping.segments, base_out.clone())
            err = float((got - want).norm() / (want - base_out).norm())
            print(f"check B={b} {name}: lora vs float32 twin, error / update norm {err:.2e}", flush=True)
            rows.append({"batch": b, "projection": name, "check_error": err})
        for names in [[n] for n in PROJECTIONS] + [list(PROJECTIONS)]:
            label = names[0] if len(names) == 1 else "layer"
            row = next((r for r in rows if r["batch"] == b and r["projection"] == label), None)
            if row is None:
                row = {"batch": b, "projection": label, "check_error": max(r["check_error"] for r in rows
                                                                           if r["batch"] == b)}
                rows.append(row)
            for mode, timer in (("device", graph_ms), ("eager", eager_ms)):
                row[f"base_{mode}_ms"] = timer(base(names), device)
                row[f"lora_{mode}_ms"] = timer(lora(names), device)
    del weights, slots
    return rows


def generate(llm: LLM, prompts: list[dict], params: SamplingParams,
             loras: list[LoRARequest] | None) -> tuple[float, list[list[int]]]:
    """(output tokens/s of the whole workload, each request's tokens)."""
    llm.reset_prefix_cache()  # every run computes its prompts (a warm-up or an earlier run used the same ones)
    if llm.engine.executor.driver_runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def free_memory(device: torch.device) -> None:
    """After the caller dropped its last reference to an engine: its weights, KV cache and graphs
    go back to the device (engines never coexist)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"# device memory allocated after freeing the engine: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB",
              flush=True)


def engine_level(ckpt: Path, adapters: list[Path], rank: int, num: int, input_len: int, output_len: int,
                 device: torch.device, smoke: bool, result: dict[str, Any], save: Callable[[], None]) -> None:
    """Module doc, (b): base engine, then the LoRA engine (lora-off, lora-4); results into `result`."""
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(random.Random(3), num, input_len, vocab)
    # warm-up: the whole batch for a few tokens (the kernels' variants for these shapes compiled before
    # any timing), then one request per adapter on the LoRA engine (its BGMV kernel, the adapters read)
    warm_prompts = random_prompts(random.Random(4), num, input_len, vocab)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    loras = [LoRARequest(f"adapter{i % NUM_ADAPTERS}", i % NUM_ADAPTERS + 1, str(adapters[i % NUM_ADAPTERS]))
             for i in range(num)]
    kw: dict[str, Any] = dict(device=device.type, max_model_len=input_len + output_len + 16, max_num_seqs=num,
                              max_num_batched_tokens=8192 if not smoke else 512,
                              kv_cache_memory_bytes=(10 << 30) if not smoke else (64 << 20))
    engine = result.setdefault("engine", {"requests": num, "input": input_len, "output": output_len, "runs": {}})
    t0 = time.perf_counter()
    llm = LLM(str(ckpt), **kw)
    engine["base_start_s"] = time.perf_counter() - t0
    engine["base_cuda_graphs"] = llm.engine.executor.driver_runner.graph_runner is not None
    generate(llm, warm_prompts, warm, None)
    tps, base_tokens = generate(llm, prompts, params, None)
    engine["runs"]["base"] = {"output_tokens_per_s": tps}
    print(f"# base: {tps:.0f} output tok/s (start-up {engine['base_start_s']:.1f} s)", flush=True)
    freed = weakref.ref(llm.engine)
    llm.shutdown()
    del llm  # the last reference: shutdown() alone frees nothing
    free_memory(device)
    engine["base_engine_freed"] = freed() is None
    save()
    t0 = time.perf_counter()
    llm = LLM(str(ckpt), enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=rank, **kw)
    engine["lora_start_s"] = time.perf_counter() - t0
    engine["lora_cuda_graphs"] = llm.engine.executor.driver_runner.graph_runner is not None
    try:
        generate(llm, warm_prompts, warm, None)
        generate(llm, warm_prompts[:NUM_ADAPTERS], warm, loras[:NUM_ADAPTERS])
        tps, off_tokens = generate(llm, prompts, params, None)
        engine["runs"]["lora-off"] = {"output_tokens_per_s": tps,
                                      "same_tokens_as_base": sum(a == b for a, b in zip(off_tokens, base_tokens))}
        print(f"# lora-off: {tps:.0f} output tok/s (start-up {engine['lora_start_s']:.1f} s)", flush=True)
        save()
        tps, lora_tokens = generate(llm, prompts, params, loras)
        # requests whose greedy tokens the adapters changed: 0 would mean no update was applied
        engine["runs"]["lora-4"] = {"output_tokens_per_s": tps,
                                    "requests_differing_from_base": sum(a != b for a, b in zip(lora_tokens, base_tokens))}
        print(f"# lora-4: {tps:.0f} output tok/s", flush=True)
    finally:
        freed = weakref.ref(llm.engine)
        llm.shutdown()
        del llm
        free_memory(device)
        engine["lora_engine_freed"] = freed() is None
    save()


def fit_requests(rows: list[dict[str, Any]], num_layers: int, num: int, tokens_per_request: int, limit_s: float,
                 ) -> tuple[int, float]:
    """The largest of num, num/2, ... (at least 16) whose predicted extra LoRA kernel time fits
    `limit_s`, and that prediction at `num`: layers x the per-token layer cost at the largest
    timed batch x every prompt and output token."""
    top = max((r for r in rows if r["projection"] == "layer"), key=lambda r: r["batch"])
    mode = "device" if math.isfinite(top["lora_device_ms"]) and math.isfinite(top["base_device_ms"]) else "eager"
    per_token_s = max(0.0, top[f"lora_{mode}_ms"] - top[f"base_{mode}_ms"]) / 1e3 / top["batch"]
    predicted = num_layers * per_token_s * num * tokens_per_request
    fitted = num
    while fitted > 16 and num_layers * per_token_s * fitted * tokens_per_request > limit_s:
        fitted //= 2
    return fitted, predicted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="an HF-layout checkpoint (default: a Llama-3-8B-shaped one written "
                                         "first, minutes; --smoke: a tiny one)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-lora-extra-s", type=float, default=15.0,
                    help="halve the engine workload while the predicted extra LoRA kernel time exceeds this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks/lora_gpu.py needs a CUDA GPU (none is visible to torch); nothing was measured. "
              "--smoke runs the script on CPU with a tiny checkpoint.")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    batch_sizes, num, input_len, output_len = ((1, 4), 8, 16, 8) if args.smoke else (
        tuple(args.batch_sizes), args.requests, args.input_len, args.output_len)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
                              "torch": torch.__version__, "rank": args.rank, "adapters": NUM_ADAPTERS}
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
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        result["checkpoint"] = str(ckpt)
        t0 = time.perf_counter()
        adapters = write_adapters(cfg, root / "adapters", NUM_ADAPTERS, args.rank, device)
        result["adapters_write_s"] = time.perf_counter() - t0
        print(f"# {NUM_ADAPTERS} rank-{args.rank} adapters written in {result['adapters_write_s']:.1f} s", flush=True)
        rows: list[dict[str, Any]] = []
        try:
            rows = kernel_level(cfg, adapters, args.rank, list(batch_sizes), device, dtype)
            result["kernel"] = rows
        except Exception:  # the engine part still runs: one failure must not cost the other figure
            traceback.print_exc()
            failed.append("kernel")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
        if rows and device.type == "cuda":
            fitted, predicted = fit_requests(rows, cfg["num_hidden_layers"], num, input_len + output_len,
                                             args.max_lora_extra_s)
            result["predicted_lora_extra_s"] = predicted
            if fitted != num:
                print(f"# lora-4's extra kernel time predicted {predicted:.1f} s at {num} requests: "
                      f"{fitted} requests instead (--max-lora-extra-s {args.max_lora_extra_s})", flush=True)
                num = fitted
        try:
            engine_level(ckpt, adapters, args.rank, num, input_len, output_len, device, args.smoke, result, save)
        except Exception:
            traceback.print_exc()
            failed.append("engine")
    print_tables(result, args.smoke)
    result["failed"] = failed
    save()
    return 1 if failed else 0


def print_tables(result: dict[str, Any], smoke: bool) -> None:
    print(f"\n# multi-LoRA, {result['device']}: {result['adapters']} adapters of rank {result['rank']} on every "
          f"projection; {result['checkpoint']}")
    if result.get("kernel"):
        print("## one layer's projections: median ms, base F.linear vs + BGMV update ('device': CUDA-graph replay; "
              "'eager': one Python-launched call)")
        print("| B | projection | base device | lora device | extra device | base eager | lora eager | extra eager "
              "| check error |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in result["kernel"]:
            if "base_device_ms" not in r:
                continue
            print(f"| {r['batch']} | {r['projection']} | {r['base_device_ms']:.4f} | {r['lora_device_ms']:.4f} | "
                  f"{r['lora_device_ms'] / r['base_device_ms']:.2f}x | {r['base_eager_ms']:.4f} | "
                  f"{r['lora_eager_ms']:.4f} | {r['lora_eager_ms'] / r['base_eager_ms']:.2f}x | {r['check_error']:.1e} |")
    engine = result.get("engine")
    if engine and engine.get("runs"):
        runs = engine["runs"]
        base = runs.get("base", {}).get("output_tokens_per_s")
        off = runs.get("lora-off", {}).get("output_tokens_per_s")
        print(f"## offline LLM.generate: {engine['requests']} requests x {engine['input']} -> {engine['output']} "
              f"(greedy, ignore_eos); CUDA graphs: base {'on' if engine.get('base_cuda_graphs') else 'off'}, "
              f"LoRA engine {'on' if engine.get('lora_cuda_graphs') else 'off'}")
        print("| engine | output tok/s | vs base | vs lora-off | note |")
        print("|---|---:|---:|---:|---|")
        for name, r in runs.items():
            tps = r["output_tokens_per_s"]
            note = (f"{r['requests_differing_from_base']} of {engine['requests']} requests' tokens differ from base"
                    if "requests_differing_from_base" in r else
                    f"{r['same_tokens_as_base']} of {engine['requests']} requests' tokens equal base's"
                    if "same_tokens_as_base" in r else "")
            print(f"| {name} | {tps:.1f} | {tps / base:.2f} | {tps / off if off else float('nan'):.2f} | {note} |")
    if smoke:
        print("(smoke: a tiny model on CPU, the kernel interpreted: the times mean nothing)")


if __name__ == "__main__":
    sys.exit(main())
