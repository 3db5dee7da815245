"""Quantized weights and the FP8 KV cache on CPU (issue 13): float32, int8 and fp8 side by side.

    python benchmarks/quantized_cpu.py [--repeats 3] [--json out.json] [--skip-kernels] [--skip-decode]
    python benchmarks/quantized_cpu.py --only-int4-decode [--repeats 5]     # part 5 alone

Four parts, every peer measured in this process, interleaved per repeat, medians reported:
1. Kernel: one projection of 4096 x 4096 at M = 1, 8, 32 rows, cycling through 24 such
   weights (1.5 GiB in float32, 384 MiB in one byte: more than this machine's L3, as a real
   model's weights are), for the C kernel on float32 panels, on int8 and FP8 panels, torch's
   `_weight_int8pack_mm` (the int8 path without the C kernels) and the dequantize-per-call twin.
2. Decode: tokens/s of pure-decode engine steps at batch 1, 8 and 32 on a 540M-parameter
   Llama-shaped random model (hidden 2048, 12 layers, GQA 16/4, intermediate 5632; 2.0 GiB in
   float32, 0.5 GiB in int8), with the bytes each step reads (weights held + KV read) and the
   GB/s that makes. Target: int8 at batch 1 >= 2.5x float32.
3. Offline throughput on the issue-2 workload (benchmarks/throughput_vs_hf.py's model and 64
   requests) for float32, int8 and fp8 weights.
4. KV capacity: blocks for the same budget with --kv-cache-dtype auto and fp8.
5. 4-bit (issue 34): batch-1 decode tokens/s of a ~0.4B Llama-shaped random model (hidden
   1024, 28 layers, GQA 16/4, intermediate 2816, vocab 32000: 316M matmul + 66M embedding/LM
   head parameters) with int4 weights in groups of 32 (a compressed-tensors W4A16 checkpoint
   written from it, symmetric), int8 (--quantization int8) and float32, each loaded once,
   interleaved per repeat. Part 1 also runs the 4-bit kernel (groups of 32).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_vs_hf import MODEL as ISSUE2_MODEL  # noqa: E402
from throughput_vs_hf import workload  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from stoker import LLM, SamplingParams  # noqa: E402
from stoker.kernels import reference  # noqa: E402
from stoker.kernels.cpu import linear as cpu_linear  # noqa: E402
from stoker.kernels.cpu import linear_q4 as cpu_q4  # noqa: E402
from stoker.quantization import formats, int4  # noqa: E402
from stoker.testing.quantized_checkpoint import quantize_checkpoint  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

DECODE_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024)
WEIGHTS = ("float32", "int8", "fp8")
INT4_DECODE_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)


# ---------------------------------------------------------------- 1. kernels
def bench_kernels(repeats: int) -> list[dict]:
    n = k = 4096
    layers = 24
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / 64 for _ in range(layers)]
    f32 = [cpu_linear.pack_linear_weight(w) for w in weights]
    q8 = {}
    for dtype in ("int8", "fp8"):
        qs = [formats.quantize_rows(w, dtype) for w in weights]
        q8[dtype] = [(cpu_linear.pack_linear_weight(q), cpu_linear.pack_scales(s, q.dtype), q, s) for q, s in qs]
    q4 = []
    for w in weights:  # groups of 32, symmetric: (panels, scales, offsets)
        q, sc, off = int4.quantize(w, 32, symmetric=True)
        q4.append((cpu_q4.pack_q4_weight(q), *cpu_q4.pack_q4_scales(sc, off)))
    del weights
    gc.collect()
    impls = {
        "float32 C": (lambda i, x: cpu_linear.linear(x, f32[i], n), 4),
        "int8 C": (lambda i, x: cpu_linear.linear_q8(x, q8["int8"][i][0], q8["int8"][i][1], k, n), 1),
        "fp8 C": (lambda i, x: cpu_linear.linear_q8(x, q8["fp8"][i][0], q8["fp8"][i][1], k, n), 1),
        "int4 C, groups of 32": (lambda i, x: cpu_q4.linear_q4(x, q4[i][0], q4[i][1], q4[i][2], 32, n), 0.5),
        "int8 torch _weight_int8pack_mm": (lambda i, x: torch.ops.aten._weight_int8pack_mm(x, q8["int8"][i][2], q8["int8"][i][3].view(-1)), 1),
        "int8 twin (dequantize per call)": (lambda i, x: reference.w8_linear(x, q8["int8"][i][2], q8["int8"][i][3], k), 1),
    }
    rows = []
    for m in (1, 8, 32):
        x = torch.randn(m, k)
        times: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(repeats):
            for name, (fn, _) in impls.items():
                if name.startswith("int8 t") and m > 8:
                    continue  # minutes at M = 32 (measured once: 0.3 s per call)
                fn(0, x)
                t = time.perf_counter()
                for i in range(layers):
                    fn(i, x)
                times[name].append((time.perf_counter() - t) / layers)
        for name, (_, elem_bytes) in impls.items():
            if times[name]:
                sec = statistics.median(times[name])
                rows.append({"M": m, "impl": name, "ms": sec * 1e3, "weight_GBps": n * k * elem_bytes / sec / 1e9})
    return rows


# ---------------------------------------------------------------- 2. decode
def decode_steps(llm: LLM, batch: int, input_len: int, steps: int, cpu_times: list[float] | None = None) -> float:
    """Median seconds of a pure-decode engine step with `batch` sequences in flight; `cpu_times`
    gets each measured step's process CPU seconds (what a shared machine's waits leave out)."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    engine = llm.engine
    for i in range(batch):
        ids = [rng.randrange(5, 1000) for _ in range(input_len)]
        engine.add_request(engine.input_processor.process(f"d{batch}-{i}", None, params, ids))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()  # prefill (and the first token)
    times, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    if cpu_times is not None:
        cpu_times.extend(cpu[2:])
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    return statistics.median(times[2:])


def bench_decode(repeats: int, tmp: Path) -> list[dict]:
    path = make_tiny_checkpoint(tmp / "decode", "llama", **DECODE_MODEL)
    results: dict[tuple[str, int], list[float]] = {}
    info: dict[str, dict] = {}
    for _ in range(repeats):
        for wdtype in WEIGHTS:
            llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=256 << 20, max_num_seqs=32,
                      quantization=None if wdtype == "float32" else wdtype)
            runner = llm.engine.executor.driver_runner
            embed = runner.model.model.embed_tokens.weight
            info[wdtype] = {"weight_bytes_read": runner.weight_bytes_held() - embed.numel() * embed.element_size(),
                            "kv_bytes_per_token": runner.kv_spec.bytes_per_token}
            for batch in (1, 8, 32):
                results.setdefault((wdtype, batch), []).append(decode_steps(llm, batch, input_len=64, steps=16))
            del llm, runner, embed
            gc.collect()
    rows = []
    for (wdtype, batch), times in results.items():
        sec = statistics.median(times)
        # bytes one step reads: every weight but the embedding (rows gathered) + K/V of ~70 positions per sequence
        step_bytes = info[wdtype]["weight_bytes_read"] + batch * 72 * info[wdtype]["kv_bytes_per_token"]
        rows.append({"weights": wdtype, "batch": batch, "step_ms": sec * 1e3, "tokens_per_s": batch / sec,
                     "step_MB": step_bytes / 1e6, "GBps": step_bytes / sec / 1e9})
    return rows


# ---------------------------------------------------------------- 5. int4 decode, ~0.4B model
def bench_int4_decode(repeats: int, tmp: Path) -> dict:
    path = make_tiny_checkpoint(tmp / "int4", "llama", **INT4_DECODE_MODEL)
    w4 = quantize_checkpoint(path, tmp / "int4-w4a16-g32", "ct-w4a16-group")  # groups of 32, symmetric
    configs = {"float32": (path, None), "int8": (path, "int8"), "int4 (W4A16, groups of 32)": (w4, None)}
    llms = {name: LLM(str(p), max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=4, quantization=q)
            for name, (p, q) in configs.items()}
    held = {name: llm.engine.executor.driver_runner.weight_bytes_held() for name, llm in llms.items()}
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(repeats):
        for name, llm in llms.items():
            times[name].append(decode_steps(llm, 1, input_len=64, steps=32))
    rows = []
    for name, t in times.items():
        sec = statistics.median(t)
        rows.append({"weights": name, "tokens_per_s": 1 / sec, "step_ms": sec * 1e3, "weight_MB_held": held[name] / 1e6,
                     "per_repeat_tokens_per_s": [round(1 / x, 2) for x in t]})
    return {"model": INT4_DECODE_MODEL, "rows": rows}


# ---------------------------------------------------------------- 3. offline throughput
def bench_offline(repeats: int, tmp: Path) -> list[dict]:
    path = make_tiny_checkpoint(tmp / "issue2", "llama", **ISSUE2_MODEL)
    reqs = workload()
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    out_tokens = sum(n for _, n in reqs)
    llms = {w: LLM(str(path), max_model_len=512, kv_cache_memory_bytes=512 << 20, quantization=None if w == "float32" else w) for w in WEIGHTS}
    times: dict[str, list[float]] = {w: [] for w in WEIGHTS}
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:8], params[:8], use_tqdm=False)
    for _ in range(repeats):
        for w, llm in llms.items():
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[w].append(time.perf_counter() - t)
            llm.engine.check_integrity()
    return [{"weights": w, "output_tokens_per_s": out_tokens / statistics.median(t), "runs": len(t)} for w, t in times.items()]


# ---------------------------------------------------------------- 4. KV capacity
def bench_kv_capacity(tmp: Path) -> list[dict]:
    path = tmp / "issue2"
    rows = []
    for kv in ("auto", "fp8"):
        llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=512 << 20, kv_cache_dtype=kv)
        rows.append({"kv_cache_dtype": kv, "budget_MiB": 512, "blocks": llm.engine.block_manager.num_blocks,
                     "bytes_per_token": llm.engine.executor.driver_runner.kv_spec.bytes_per_token,
                     "tokens": llm.engine.block_manager.num_blocks * llm.engine.executor.driver_runner.block_size})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--only-int4-decode", action="store_true", help="part 5 alone")
    args = ap.parse_args()
    out: dict = {"machine": f"{cpu_model()}, ISA build {cpu_linear.target()}, {torch.get_num_threads()} threads",
                 "torch": torch.__version__, "repeats": args.repeats}
    print(f"# {out['machine']}; torch {torch.__version__}; medians of {args.repeats} interleaved repeats")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only_int4_decode:
            out["int4_decode"] = bench_int4_decode(args.repeats, tmp)
            base = out["int4_decode"]["rows"][0]["tokens_per_s"]
            print("\n## 5. batch-1 decode, ~0.4B Llama\n\n| weights | tokens/s | vs float32 | step ms | weight MB held | per repeat |\n|---|---|---|---|---|---|")
            for r in out["int4_decode"]["rows"]:
                print(f"| {r['weights']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | {r['step_ms']:.1f} | "
                      f"{r['weight_MB_held']:.0f} | {r['per_repeat_tokens_per_s']} |")
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=2))
            return
        if not args.skip_kernels:
            out["kernels"] = bench_kernels(args.repeats)
            print("\n## 1. one 4096 x 4096 projection (24 weights cycled)\n\n| M | implementation | ms | weight GB/s |\n|---|---|---|---|")
            for r in out["kernels"]:
                print(f"| {r['M']} | {r['impl']} | {r['ms']:.2f} | {r['weight_GBps']:.1f} |")
        if not args.skip_decode:
            out["decode"] = bench_decode(args.repeats, tmp)
            base = {r["batch"]: r["tokens_per_s"] for r in out["decode"] if r["weights"] == "float32"}
            print("\n## 2. decode steps, 540M-parameter model\n\n| weights | batch | step ms | tokens/s | vs float32 | MB read per step | GB/s |\n|---|---|---|---|---|---|---|")
            for r in out["decode"]:
                print(f"| {r['weights']} | {r['batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
                      f"{r['tokens_per_s'] / base[r['batch']]:.2f}x | {r['step_MB']:.0f} | {r['GBps']:.1f} |")
        out["offline"] = bench_offline(args.repeats, tmp)
        print("\n## 3. offline throughput, issue-2 workload (64 requests)\n\n| weights | output tokens/s | vs float32 |\n|---|---|---|")
        base32 = out["offline"][0]["output_tokens_per_s"]
        for r in out["offline"]:
            print(f"| {r['weights']} | {r['output_tokens_per_s']:.0f} | {r['output_tokens_per_s'] / base32:.2f}x |")
        out["kv_capacity"] = bench_kv_capacity(tmp)
        print("\n## 4. KV capacity, issue-2 model, 512 MiB\n\n| --kv-cache-dtype | blocks | tokens | bytes per token |\n|---|---|---|---|")
        for r in out["kv_capacity"]:
            print(f"| {r['kv_cache_dtype']} | {r['blocks']:,} | {r['tokens']:,} | {r['bytes_per_token']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
