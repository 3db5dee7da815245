"""The GPU figures of one machine in one process: its ceilings, start-up to ready, prefill MFU,
decode step time and MBU per batch size (graphs and eager), and offline throughput beside HF.

    python3 benchmarks/gpu_figures.py --out DIR                        # Llama-3-8B-shaped, bf16
    python3 benchmarks/gpu_figures.py --out DIR --shape tiny --device cpu --parts all   # a dry run

Parts (--parts, comma-separated, in this order; `all` is every one; `checkpoint` alone only
writes the checkpoint):
  ceilings  device-to-device copy rate (bytes read + written) and a bf16 8192^3 matmul on random
            data, each the median of 20 event-timed runs: the MBU and MFU denominators below.
  serve     `stoker serve CKPT` to ready (GET /health 200), with graph capture; every log line is
            stamped with seconds since launch, which is the breakdown (weights, KV, graphs, ready).
  prefill   8 prompts x 2048 distinct random tokens, max_tokens 1, in one step
            (max_num_batched_tokens 16384): MFU = (2 x body params x tokens + causal attention
            FLOPs) / time / the measured bf16 rate. Median of 3 after one warm-up.
  decode    (after offline: its timers stay wrapped round the engine's parts) benchmarks/step_overhead.py's timer at B = 1, 8, 32, 64, 128, 256, prompt 1024,
            32 output tokens, graphs on; then B = 1, 64 with the graphs set aside (eager).
            MBU = (weight bytes read per step + KV bytes read) / GPU forward time / copy rate.
  offline   1000 prompts 128 -> 128 and 200 prompts 2048 -> 128 (ignore_eos, greedy) through
            LLM.generate (--workloads; 1000:1000:1000 is the long one), then HF transformers on the
            128 -> 128 prompts on the same GPU (sdpa, bf16): `generate` on one left-padded static
            batch of each --hf-batches size, and continuous batching (`generate_batch`) on
            --hf-cb-prompts prompts; output tokens/s each, and Stoker's over HF's best.

  profile   (only when named) an eager engine, B = 1 and 64 at prompt 1024: the device time of
            each kernel over 5 pure-decode steps (torch.profiler), per step, largest first, and
            their sum beside the bytes-over-copy-rate floor. Kernel durations do not depend on
            launching eagerly or from a graph; the gaps between them do.

The checkpoint is written by this script from random bf16 tensors made on the device (an 8B
model's 16 GB would take minutes through HF's CPU init): names and shapes come from HF's
LlamaForCausalLM built on the meta device, the vocabulary is the demo tokenizer's 1024 (the real
Llama-3 LM head, 128256 x 4096, would add 1.05 GB read per decode step).
Writes DIR/gpu_figures.json and prints a table per part.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import SHAPES, StepTimer, run_batch  # noqa: E402

from stoker import LLM, SamplingParams  # noqa: E402
from stoker.testing.tiny_checkpoint import TINY, copy_demo_tokenizer  # noqa: E402

PARTS = ["ceilings", "serve", "prefill", "offline", "decode"]  # `profile` runs only when named


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn` over `reps` runs (CUDA events on a GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ceilings(device: torch.device, small: bool) -> dict[str, float]:
    n_bytes = (64 << 20) if small else (4 << 30)  # 4 GiB: far past the 50-60 MB L2
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timed_ms(lambda: dst.copy_(src), device)
    copy_gbs = 2 * n_bytes / copy_ms / 1e6  # bytes read + bytes written
    del src, dst
    n = 1024 if small else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    mm_ms = timed_ms(lambda: a @ b, device)
    del a, b
    return {"copy_gb_s": copy_gbs, "copy_bytes": 2 * n_bytes, "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
            "matmul_n": n, "matmul_dtype": str(dtype).removeprefix("torch.")}


def write_checkpoint(path: Path, shape: str, device: torch.device, dtype: torch.dtype) -> Path:
    """A random Llama checkpoint written from tensors made on `device` (see the module doc)."""
    import transformers
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    kwargs = {**TINY, **SHAPES[shape], "bos_token_id": 0, "eos_token_id": 4, "torch_dtype": str(dtype).removeprefix("torch."),
              "architectures": ["LlamaForCausalLM"]}
    config = transformers.LlamaConfig(**kwargs)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index, files = 0, {}, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, files
        if shard:
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            files += 1
            shard, shard_bytes = {}, 0

    for name, p in meta.state_dict().items():
        if p.dim() == 1:  # norms: ones, as HF initialises them
            t = torch.ones(p.shape, dtype=dtype, device=device)
        else:
            std = 0.15 if "embed" in name or "lm_head" in name else 0.02
            t = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(std).to(dtype)
        shard[name] = t.cpu()
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= (2 << 30):
            flush()
    flush()
    total = sum(t.numel() for t in meta.state_dict().values()) * torch.finfo(dtype).bits // 8
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    config.save_pretrained(path)
    copy_demo_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 4}))
    return path


def serve_startup(ckpt: Path, out: Path, port: int, timeout_s: float) -> dict[str, Any]:
    """Launch `stoker serve`, stamp its log lines, return seconds to /health 200."""
    cmd = [sys.executable, "-m", "stoker", "serve", str(ckpt), "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(f"[{time.perf_counter() - t0:7.2f} s] {line.rstrip()}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    ready_s = None
    try:
        while time.perf_counter() - t0 < timeout_s and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        ready_s = time.perf_counter() - t0
                        break
            except OSError:
                pass
            time.sleep(0.1)
        completion = None
        if ready_s is not None:
            body = json.dumps({"model": str(ckpt), "prompt": "hello", "max_tokens": 8}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
            t1 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=60) as r:
                completion = {"status": r.status, "ms": (time.perf_counter() - t1) * 1e3}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    (out / "serve_startup.log").write_text("\n".join(lines) + "\n")
    return {"ready_s": ready_s, "first_completion": completion, "exit_code": proc.returncode,
            "log_tail": [ln for ln in lines if any(k in ln for k in ("weights", "KV cache", "captured", "ready", "Error", "error"))]}


def random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(length)]} for _ in range(n)]


def body_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters in matmuls per token, bytes read per decode step): every weight but the input
    embedding, which a step reads only B rows of."""
    params = bytes_ = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        bytes_ += p.numel() * p.element_size()
        if p.dim() > 1:
            params += p.numel()
    return params, bytes_


def prefill_mfu(llm: LLM, cfg: dict[str, Any], ceil: dict[str, float], small: bool) -> dict[str, Any]:
    n, length = (2, 64) if small else (8, 2048)
    rng = random.Random(1)
    vocab = llm.engine.hf_config["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runner = llm.engine.executor.driver_runner
    times = []
    for rep in range(4):  # fresh prompts every time: no prefix-cache hit
        prompts = random_prompts(rng, n, length, vocab)
        sync(runner.device)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync(runner.device)
        if rep:
            times.append(time.perf_counter() - t0)
    matmul_params, _ = body_params(runner.model)
    tokens = n * length
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    attn_flops = n * layers * 2 * length * length * hidden  # QK^T and PV, causal half of 2 x 2 x S^2 x H
    lm_head = cfg["vocab_size"] * hidden
    flops = 2 * (matmul_params - lm_head) * tokens + 2 * lm_head * n + attn_flops
    t = statistics.median(times)
    return {"prompts": n, "length": length, "seconds": t, "tflops": flops / t / 1e12,
            "mfu_measured": flops / t / 1e12 / ceil["matmul_tflops"], "tokens_per_s": tokens / t}


def decode_sweep(llm: LLM, batch_sizes: list[int], input_len: int, output_len: int, ceil: dict[str, float],
                 eager: bool = True) -> list[dict[str, Any]]:
    runner = llm.engine.executor.driver_runner
    _, weight_bytes = body_params(runner.model)
    kv_per_token = runner.kv_spec.bytes_per_token
    results = []
    saved = runner.graph_runner
    for graphs in ([True, False] if saved is not None and eager else [True] if saved is not None else [False]):
        runner.graph_runner = saved if graphs else None
        sizes = batch_sizes if graphs else [b for b in batch_sizes if b in (1, 64)] or batch_sizes[:1]
        timer = StepTimer(llm)
        try:
            for b in sizes:
                r = run_batch(llm, timer, b, input_len, output_len, warmup=3, seed=b + (0 if graphs else 7))
                m = r["median_ms"]
                if not m:
                    continue
                # mean context over the timed steps ~ prompt + half the output
                kv_bytes = b * (input_len + output_len / 2) * kv_per_token
                busy = m["forward_gpu"] if runner.device.type == "cuda" else m["forward"]
                r.update(graphs=graphs, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                         mbu_forward=(weight_bytes + kv_bytes) / (busy / 1e3) / (ceil["copy_gb_s"] * 1e9),
                         mbu_step=(weight_bytes + kv_bytes) / (m["step"] / 1e3) / (ceil["copy_gb_s"] * 1e9),
                         tokens_per_s=b / (m["step"] / 1e3), host_pct=100 * max(0.0, m["step"] - busy) / m["step"])
                results.append(r)
        finally:
            timer.close()
    runner.graph_runner = saved
    return results


def profile_decode(llm: LLM, batch_sizes: list[int], input_len: int, ceil: dict[str, float], steps: int = 5) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    runner = llm.engine.executor.driver_runner
    _, weight_bytes = body_params(runner.model)
    vocab = llm.engine.hf_config["vocab_size"]
    activity = ProfilerActivity.CUDA if runner.device.type == "cuda" else ProfilerActivity.CPU
    out = []
    for b in batch_sizes:
        rng = random.Random(100 + b)
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(b):
            ids = [rng.randrange(5, vocab) for _ in range(input_len)]
            llm.engine.add_request(llm.engine.input_processor.process(f"p{b}-{i}", None, params, ids))
        while any(s.num_computed_tokens < input_len for s in llm.engine.scheduler.running) or llm.engine.scheduler.waiting:
            llm.engine.step()
        for _ in range(2):  # warm: every decode kernel compiled
            llm.engine.step()
        sync(runner.device)
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                llm.engine.step()
            sync(runner.device)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        kernels = []
        for e in prof.key_averages():
            us = e.device_time_total if runner.device.type == "cuda" else e.self_cpu_time_total
            if us > 0:
                kernels.append({"name": e.key[:90], "us_per_step": us / steps, "calls_per_step": e.count / steps})
        kernels.sort(key=lambda k: -k["us_per_step"])
        total_us = sum(k["us_per_step"] for k in kernels)
        kv_bytes = b * (input_len + 4) * runner.kv_spec.bytes_per_token
        floor_us = (weight_bytes + kv_bytes) / (ceil["copy_gb_s"] * 1e3)
        out.append({"batch_size": b, "kernel_us_per_step": total_us, "floor_us": floor_us, "kernels": kernels[:25]})
    return out


def offline_stoker(llm: LLM, small: bool, workloads: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    rng = random.Random(2)
    vocab = llm.engine.hf_config["vocab_size"]
    out = []
    workloads = workloads if not small else [(16, 32, 16)]
    for n, inp, outp in workloads:
        prompts = random_prompts(rng, n, inp, vocab)
        params = SamplingParams(temperature=0, max_tokens=outp, ignore_eos=True)
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        t = time.perf_counter() - t0
        generated = sum(len(r.outputs[0].token_ids) for r in res)
        out.append({"engine": "stoker", "prompts": n, "input": inp, "output": outp, "seconds": t,
                    "output_tokens_per_s": generated / t, "total_tokens_per_s": (generated + n * inp) / t})
    return out


def offline_hf(ckpt: Path, device: torch.device, dtype: torch.dtype, small: bool, batches: list[int],
               cb_prompts: int) -> list[dict[str, Any]]:
    """HF transformers on the 128 -> 128 workload, one model load: `generate` on one left-padded
    static batch per size in `batches` (sdpa), then continuous batching (`generate_batch`, its
    paged cache) on `cb_prompts` prompts. Output tokens are counted from what each returned, so
    an early EOS lowers the figure rather than inflating it. A run that fails is recorded with
    its error and the others go on."""
    import transformers

    inp, outp = (32, 16) if small else (128, 128)
    batches = [16] if small else batches
    cb_prompts = 16 if small else cb_prompts
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa",
                                                              device_map=str(device)).eval()
    rng = random.Random(2)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(inp)] for _ in range(max(batches + [cb_prompts]))]
    kwargs = dict(max_new_tokens=outp, min_new_tokens=outp, do_sample=False, pad_token_id=0)
    out: list[dict[str, Any]] = []
    with torch.no_grad():
        ids = torch.tensor(prompts[:2], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        for n in batches:
            row: dict[str, Any] = {"engine": "hf generate (static batch)", "batch": n, "prompts": n, "input": inp, "output": outp}
            try:
                ids = torch.tensor(prompts[:n], device=device)
                sync(device)
                t0 = time.perf_counter()
                res = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                sync(device)
                t = time.perf_counter() - t0
                generated = (res.shape[1] - inp) * n
                row.update(seconds=t, output_tokens_per_s=generated / t, total_tokens_per_s=(generated + n * inp) / t)
            except Exception as e:  # noqa: BLE001 - a failed peer run is a recorded result, not the end of the run
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            out.append(row)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row = {"engine": "hf continuous batching (generate_batch)", "prompts": cb_prompts, "input": inp, "output": outp}
        try:
            config = transformers.GenerationConfig(max_new_tokens=outp, do_sample=False, eos_token_id=None, pad_token_id=0)
            model.generate_batch(inputs=prompts[:2], generation_config=config)  # warm-up (graphs, cache sizing)
            sync(device)
            t0 = time.perf_counter()
            res = model.generate_batch(inputs=prompts[:cb_prompts], generation_config=config)
            sync(device)
            t = time.perf_counter() - t0
            generated = sum(len(r.generated_tokens) for r in res.values())
            row.update(seconds=t, output_tokens_per_s=generated / t, total_tokens_per_s=(generated + cb_prompts * inp) / t,
                       generated_tokens=generated)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        out.append(row)
    del model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="all")
    ap.add_argument("--checkpoint", help="an existing checkpoint (default: written to OUT/ckpt-SHAPE)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--kv-cache-gib", type=float, default=40.0)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engine's max_num_seqs (default: the largest --batch-sizes); HF's best static batch was 512")
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--no-eager", action="store_true", help="decode: graphs only, no eager rows")
    ap.add_argument("--workloads", nargs="+", default=["1000:128:128", "200:2048:128"],
                    help="offline: PROMPTS:INPUT:OUTPUT each")
    ap.add_argument("--no-hf", action="store_true", help="offline: Stoker only")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[256, 512], help="offline: HF generate's static batch sizes")
    ap.add_argument("--hf-cb-prompts", type=int, default=512, help="offline: prompts for HF continuous batching")
    ap.add_argument("--quantization", choices=["fp8", "int8", "int4"], default=None, help="weights quantized at load")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = ap.parse_args()
    parts = PARTS if args.parts == "all" else args.parts.split(",")
    result_name = "gpu_figures" + (f"_{args.quantization}" if args.quantization else "") + ("_kvfp8" if args.kv_cache_dtype == "fp8" else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    small = args.shape != "llama3-8b"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict[str, Any] = {"shape": args.shape, "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        import triton

        result.update(gpu=torch.cuda.get_device_name(device), triton=triton.__version__, cuda=torch.version.cuda)
    else:
        result.update(machine=platform.processor() or platform.machine())
    results_file = out / f"{result_name}.json"
    result.update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)

    def save() -> None:
        results_file.write_text(json.dumps(result, indent=2, default=str))

    if parts == ["checkpoint"]:  # only write it (benchmarks/gpu_check.sh does this beside the tests)
        ckpt = write_checkpoint(out / f"ckpt-{args.shape}", args.shape, device, dtype)
        print(f"# checkpoint {ckpt} written", flush=True)
        return
    ceil = ceilings(device, small) if "ceilings" in parts or small else {"copy_gb_s": 4300.0, "matmul_tflops": 790.0}
    result["ceilings"] = ceil
    print(f"# ceilings: copy {ceil['copy_gb_s']:.0f} GB/s (read + write), matmul {ceil['matmul_tflops']:.1f} TFLOP/s", flush=True)
    save()

    t0 = time.perf_counter()
    ckpt = Path(args.checkpoint) if args.checkpoint else write_checkpoint(out / f"ckpt-{args.shape}", args.shape, device, dtype)
    result["checkpoint_write_s"] = time.perf_counter() - t0
    print(f"# checkpoint {ckpt} ({result['checkpoint_write_s']:.1f} s)", flush=True)

    if "serve" in parts:
        s = serve_startup(ckpt, out, args.port, timeout_s=180)
        result["serve"] = s
        print(f"# serve: ready in {s['ready_s']} s; first completion {s['first_completion']}", flush=True)
        for line in s["log_tail"]:
            print("   ", line)
        save()

    cfg = json.loads((ckpt / "config.json").read_text())
    if {"prefill", "decode", "offline", "profile"} & set(parts):
        input_len, output_len = (1024, 32) if not small else (64, 8)
        max_model_len = 2048 + 128 + 64 if not small else 256
        t0 = time.perf_counter()
        llm = LLM(str(ckpt), device=args.device, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs or max(args.batch_sizes),
                  max_num_batched_tokens=16384 if not small else 512, kv_cache_memory_bytes=int((args.kv_cache_gib if not small else 0.25) * 2**30),
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        result["llm_start_s"] = time.perf_counter() - t0
        print(f"# LLM(...) ready in {result['llm_start_s']:.1f} s", flush=True)
        if "prefill" in parts:
            p = prefill_mfu(llm, cfg, ceil, small)
            result["prefill"] = p
            print(f"# prefill {p['prompts']} x {p['length']}: {p['seconds'] * 1e3:.1f} ms, {p['tflops']:.0f} TFLOP/s, "
                  f"MFU {100 * p['mfu_measured']:.1f}% of the measured matmul rate", flush=True)
            save()
        if "offline" in parts:
            o = offline_stoker(llm, small, [tuple(int(v) for v in w.split(":")) for w in args.workloads])
            result["offline"] = o
            for r in o:
                print(f"# offline stoker {r['prompts']} x {r['input']}->{r['output']}: {r['seconds']:.1f} s, "
                      f"{r['output_tokens_per_s']:.0f} output tok/s", flush=True)
            save()
        if "decode" in parts:
            d = decode_sweep(llm, args.batch_sizes if not small else [1, 4], input_len, output_len, ceil, eager=not args.no_eager)
            result["decode"] = d
            print(f"# decode, prompt {input_len}, {output_len} out; ms medians over pure-decode steps")
            print("| B | graphs | steps | step ms | forward GPU ms | forward host ms | host % | tokens/s | MBU (GPU fwd) | MBU (step) |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for r in d:
                m = r["median_ms"]
                print(f"| {r['batch_size']} | {'on' if r['graphs'] else 'off'} | {r['decode_steps']} | {m['step']:.3f} | "
                      f"{m['forward_gpu']:.3f} | {m['forward']:.3f} | {r['host_pct']:.0f} | {r['tokens_per_s']:.0f} | "
                      f"{100 * r['mbu_forward']:.1f}% | {100 * r['mbu_step']:.1f}% |", flush=True)
            save()
        if "profile" in parts:
            runner = llm.engine.executor.driver_runner
            graphs, runner.graph_runner = runner.graph_runner, None  # eager: one launch per kernel
            try:
                prof = profile_decode(llm, [1, 64] if not small else [1, 4], input_len, ceil)
            finally:
                runner.graph_runner = graphs
            result["profile"] = prof
            for p in prof:
                print(f"# decode kernels, B={p['batch_size']}: {p['kernel_us_per_step']:.0f} us of kernels per step, "
                      f"floor {p['floor_us']:.0f} us (bytes / copy rate)")
                for k in p["kernels"][:14]:
                    print(f"    {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.0f}  {k['name']}")
            save()
        llm.shutdown()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "offline" in parts and not args.no_hf:
            hf = offline_hf(ckpt, device, dtype, small, args.hf_batches, args.hf_cb_prompts)
            result["offline"].extend(hf)
            for h in hf:
                what = f"batch {h['batch']}" if "batch" in h else f"{h['prompts']} prompts"
                done = f"{h['seconds']:.1f} s, {h['output_tokens_per_s']:.0f} output tok/s" if "seconds" in h else h["error"]
                print(f"# offline {h['engine']} {what} x {h['input']}->{h['output']}: {done}", flush=True)
            best = max((h["output_tokens_per_s"] for h in hf if "seconds" in h), default=None)
            same = [r for r in result["offline"] if r["engine"] == "stoker" and (r["input"], r["output"]) == (hf[0]["input"], hf[0]["output"])]
            if best and same:
                result["stoker_vs_hf_best"] = same[0]["output_tokens_per_s"] / best
                print(f"# Stoker / HF's best at {hf[0]['input']}->{hf[0]['output']}: {result['stoker_vs_hf_best']:.2f}x", flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
