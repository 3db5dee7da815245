"""Offline throughput: Stoker vs HF transformers, same model, same workload, same run.

Workload (issue 2): a Llama-shaped random model (hidden 512, intermediate 1408, 8 layers,
8 heads / 4 KV heads, vocab 1024), 64 requests, prompt lengths uniform in [32, 256], output
lengths uniform in [16, 128], ignore_eos, greedy, float32 on CPU.

Peers measured here, in this process, one after the other:
- HF `generate` with left-padded static batches (each batch runs to its longest output;
  only the requested tokens count), at several batch sizes; the best is reported;
- HF continuous batching (`generate_batch` / its manager) with per-request lengths;
- Stoker itself with its C kernels off (the torch twins), for the kernels' share.
Also measured: the float32 GEMM rate of this machine, so achieved GFLOP/s can be read as a
share of it. Usage: python benchmarks/throughput_vs_hf.py [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stoker import LLM, SamplingParams  # noqa: E402
from stoker.kernels.cpu import build as cpu_build  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024)


def workload(seed: int = 0, n: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(5, 1024) for _ in range(rng.randint(32, 256))], rng.randint(16, 128)) for _ in range(n)]


def matmul_params(model_dir: Path) -> int:
    """Parameters that cost 2 FLOPs per token: every matrix but the embedding lookup."""
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                if len(shape) == 2 and "embed_tokens" not in name:
                    total += shape[0] * shape[1]
    return total


def gemm_gflops(n: int = 2048, iters: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


# The KV cache both engines get: Stoker's kv_cache_memory_bytes, and HF continuous batching's
# num_blocks (left to itself it sizes its cache from free RAM: ~12 GB here, which made it
# slower, 137 vs 220 tok/s, and left the machine reclaiming memory while the next peer ran).
KV_CACHE_BYTES = 512 << 20


def make_stoker(model_dir: Path, reqs, cpu_kernels: bool = True) -> LLM:
    """An engine built, warmed up and run with the C kernels on, or off (the torch twins:
    the weights then stay in MKL's column-major layout instead of the kernel's panels)."""
    with kernels_switched(cpu_kernels):
        llm = LLM(str(model_dir), max_model_len=512, kv_cache_memory_bytes=KV_CACHE_BYTES)
    run_stoker(llm, reqs, cpu_kernels)  # warm-up: the BLAS library prepares its kernels per matrix shape
    return llm


@contextlib.contextmanager
def kernels_switched(on: bool):
    old = os.environ.get("STOKER_DISABLE_CPU_KERNELS")
    os.environ["STOKER_DISABLE_CPU_KERNELS"] = "0" if on else "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["STOKER_DISABLE_CPU_KERNELS"]
        else:
            os.environ["STOKER_DISABLE_CPU_KERNELS"] = old


def run_stoker(llm: LLM, reqs, cpu_kernels: bool = True) -> float:
    """One timed generate; cpu_kernels must be what the engine was built with."""
    with kernels_switched(cpu_kernels):
        return _run_stoker(llm, reqs)


def _run_stoker(llm: LLM, reqs) -> float:
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    # Every run repeats the same prompts: without this, all but the first would find them in
    # the prefix cache and skip ~95% of the prefill that HF has to compute.
    llm.reset_prefix_cache()
    hits = llm.engine.block_manager.prefix_cache_hits
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert llm.engine.block_manager.prefix_cache_hits == hits, "a timed run hit the prefix cache"
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, reqs))
    llm.engine.check_integrity()
    return elapsed


@torch.no_grad()
def run_hf_static(hf, reqs, batch_size: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[2] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        new = max(n for _, n in batch)
        hf.generate(input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return time.perf_counter() - t


@torch.no_grad()
def run_hf_continuous(hf, reqs) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=2, max_new_tokens=128)
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    page_size = 256  # ContinuousBatchingConfig's default: one block = page_size tokens of every layer's K and V
    block_bytes = c.num_hidden_layers * page_size * 2 * c.num_key_value_heads * head_dim * 4
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=KV_CACHE_BYTES // block_bytes)
    t = time.perf_counter()
    with hf.continuous_batching_context_manager(
        generation_config=cfg, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
        ids = [manager.add_request(input_ids=p, max_new_tokens=n) for p, n in reqs]
        done = 0
        while done < len(ids):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                done += 1
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--static-batch-sizes", default="8,16,32,64")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's choice)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)

    reqs = workload()
    num_out = sum(n for _, n in reqs)
    num_prompt = sum(len(ids) for ids, _ in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "m", "llama", **MODEL)
        params = matmul_params(model_dir)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 2
        results: dict[str, list[float]] = {"stoker": [], "stoker_torch_twin": [], "hf_continuous": []}
        sizes = [int(b) for b in args.static_batch_sizes.split(",")]
        for b in sizes:
            results[f"hf_static_b{b}"] = []
        gemm = []
        llm = make_stoker(model_dir, reqs)
        twin = make_stoker(model_dir, reqs, cpu_kernels=False)
        for b in sizes:  # warm-up, as for Stoker: every shape the timed runs will use
            run_hf_static(hf, reqs[: 2 * b], b)
        for r in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
            gemm.append(gemm_gflops())
            results["stoker"].append(num_out / run_stoker(llm, reqs))
            # An engine with the C kernels off: what the CPU path is without a compiler.
            results["stoker_torch_twin"].append(num_out / run_stoker(twin, reqs, cpu_kernels=False))
            for b in sizes:
                results[f"hf_static_b{b}"].append(num_out / run_hf_static(hf, reqs, b))
            try:
                results["hf_continuous"].append(num_out / run_hf_continuous(hf, reqs))
            except Exception as exc:  # report, don't hide, a peer that fails here
                print(f"HF continuous batching failed: {exc!r}", file=sys.stderr)
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items() if v), flush=True)
    med = {k: statistics.median(v) for k, v in results.items() if v}
    best_static = max((k for k in med if k.startswith("hf_static")), key=med.get)
    best_hf = max(med[best_static], med.get("hf_continuous", 0.0))
    gemm_med = statistics.median(gemm)
    achieved = med["stoker"] * (num_prompt + num_out) / num_out * 2 * params / 1e9
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, transformers {transformers.__version__}",
        "workload": {"num_requests": len(reqs), "prompt_tokens": num_prompt, "output_tokens": num_out, "matmul_params": params},
        "output_tokens_per_s_median": med,
        "cpu_kernels": "C kernels" if cpu_build.available() else "torch twins (no C kernels: see the warning above)",
        "best_hf_static": best_static,
        "ratio_vs_best_hf": med["stoker"] / best_hf,
        "gemm_gflops_median": gemm_med,
        "stoker_achieved_gflops": achieved,
        "stoker_share_of_gemm_peak": achieved / gemm_med,
        "floor_output_tokens_per_s": gemm_med * 1e9 / (2 * params * (num_prompt + num_out) / num_out),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
