"""MoE on CPU (issue 33): the one-call C kernel for a layer's routed experts against the loops it
replaced and against HF transformers' experts, and a MoE model's decode against a dense one.

    nice -n 5 python benchmarks/moe_cpu.py                  # both parts, 3 rounds, medians
    nice -n 5 python benchmarks/moe_cpu.py --part layer --json out.json
    nice -n 5 python benchmarks/moe_cpu.py --part layer --threads 1   # one core, on a loaded machine
                                                          # (adds a CPU-time table)

Part "layer": one Mixtral-ish reduced layer (E 8, top-2, H 1024, I 1536; float32, random
weights, softmax top-k routing of random logits) at 1, 8, 64 and 512 tokens; the routed
experts only (the router is the same for every peer), ms per call. Peers, run in turn each
round in one process (this machine is shared and noisy):
  c-one-call    kernels/cpu/moe.c, what PackedCpuMoEMethod runs now;
  c-per-expert  the loop it replaced: layers/moe.py's sort in torch, then the C linear
                kernel twice per expert with tokens, called from Python;
  torch-loop    reference.fused_moe, the twin (an expert-by-expert torch loop, as
                transformers' eager experts);
  hf-<impl>     transformers 5's Qwen3MoeExperts on the same weights, with the experts
                implementations eager (its loop) and grouped_mm (torch._grouped_mm).
Targets (issue 33): c-one-call never slower than torch-loop at 1 token, >= 3x from 64.

Part "model": decode tokens/s at batch 1 through `LLM.generate` of a Qwen3-30B-A3B-shaped MoE
with fewer layers (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts top-8, moe
intermediate 768, vocab 8192) against a dense Llama of the same active parameters
(intermediate 8 x 768 = 6144), both float32; decode time = time(64 + 1 tokens) - time(1 token)
for a 16-token prompt. Beside each, the roofline: weight bytes a decode step reads
(roofline/modelspec.py, `decode_weight_bytes(1)`) over this machine's read bandwidth (a
float32 sum over 1 GiB, same process), as tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.machine import cpu_model, isa  # noqa: E402

LAYER = dict(num_experts=8, top_k=2, hidden=1024, inter=1536)
TOKENS = (1, 8, 64, 512)
# Qwen3-30B-A3B's layer, fewer layers and a smaller vocab (float32 experts: 2.4 GB per layer)
QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                     norm_topk_prob=True, vocab_size=8192, max_position_embeddings=4096, tie_word_embeddings=False)


def time_calls(fn: Callable[[], Any], budget_s: float = 0.4, min_calls: int = 3) -> tuple[float, float, float]:
    """(median, fastest, median CPU time) seconds of one call: one warm-up, then calls until
    `budget_s` (at least min_calls, at most 50). The fastest call says what the code can do when
    the other processes leave both cores free; the median what it did here. The CPU time (the
    process's, time.process_time) is what a call costs while it holds a core: on one thread,
    the time the scheduler gave the other processes of a shared machine is not in it (their
    share of the memory bandwidth still is)."""
    fn()
    times: list[float] = []
    cpu: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < budget_s:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if len(times) >= 50:
            break
    return statistics.median(times), min(times), statistics.median(cpu)


def layer_peers(num_tokens: int, seed: int = 0) -> dict[str, Callable[[], torch.Tensor]]:
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from stoker.kernels import reference
    from stoker.kernels.cpu import linear as cpu_linear
    from stoker.kernels.cpu import moe as cpu_moe
    from stoker.kernels import ops
    from stoker.layers.moe import FusedMoE, PackedCpuMoEMethod
    from stoker.layers.moe_router import softmax_topk

    e, k, h, i = LAYER["num_experts"], LAYER["top_k"], LAYER["hidden"], LAYER["inter"]
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, i, generator=gen) / i**0.5
    x = torch.randn(num_tokens, h, generator=gen)
    weights, ids = softmax_topk(torch.randn(num_tokens, e, generator=gen), k, renormalize=True)
    fused = cpu_linear.gate_up_fusable(i)
    p13, p2 = cpu_moe.pack_experts(w13, w2, fused)

    per_expert = FusedMoE(e, h, i)
    method = PackedCpuMoEMethod(fused)
    method.fused_moe = None  # the per-expert loop
    per_expert.attach(method)
    per_expert.act.kernels = ops.CPU
    per_expert.w13.data, per_expert.w2.data = p13, p2  # already packed: share them

    peers: dict[str, Callable[[], torch.Tensor]] = {
        "c-one-call": lambda: cpu_moe.fused_moe(x, p13, p2, weights, ids, i, fused),
        "c-per-expert": lambda: per_expert(x, weights, ids),
        "torch-loop": lambda: reference.fused_moe(x, w13, w2, weights, ids),
    }
    want = peers["torch-loop"]()
    # batched_mm (weights gathered per (token, choice)) is left out: 132 ms at 1 token and 94 s
    # at 512 in a trial run, far behind every other peer.
    for impl in ("eager", "grouped_mm"):
        cfg = transformers.Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k)
        cfg._experts_implementation = impl
        experts = Qwen3MoeExperts(cfg)
        experts.gate_up_proj.data, experts.down_proj.data = w13, w2  # same (E, 2I, H) / (E, H, I) layout
        run = (lambda m: lambda: m(x, ids, weights))(experts)
        try:
            with torch.no_grad():
                torch.testing.assert_close(run(), want, rtol=1e-4, atol=1e-4)
        except Exception as exc:  # an implementation without a CPU path, or a different answer
            print(f"  hf-{impl} left out: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            continue
        peers[f"hf-{impl}"] = run
    for name, fn in peers.items():
        torch.testing.assert_close(fn(), want, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    return peers


def run_layer(rounds: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """ms per call: {tokens: {peer: [median of each round]}}, the same with each round's fastest
    call, and with each round's median CPU time."""
    results: dict[str, dict[str, list[float]]] = {}
    fastest: dict[str, dict[str, list[float]]] = {}
    cpu_ms: dict[str, dict[str, list[float]]] = {}
    with torch.no_grad():
        for t in TOKENS:
            peers = layer_peers(t)
            per = results.setdefault(str(t), {n: [] for n in peers})
            best = fastest.setdefault(str(t), {n: [] for n in peers})
            cpu = cpu_ms.setdefault(str(t), {n: [] for n in peers})
            for _ in range(rounds):
                for name, fn in peers.items():  # interleaved: every peer once per round
                    median, low, cpu_median = time_calls(fn)
                    per[name].append(median * 1e3)
                    best[name].append(low * 1e3)
                    cpu[name].append(cpu_median * 1e3)
            print(f"  {t} tokens: " + ", ".join(f"{n} {statistics.median(v):.3f}" for n, v in per.items()), file=sys.stderr)
    return results, fastest, cpu_ms


def read_bandwidth_gbs() -> float:
    """float32 sum over 1 GiB (torch's threads): the read bandwidth decode can hope for."""
    big = torch.ones(1 << 28)
    seconds = time_calls(lambda: big.sum(), budget_s=1.0)[0]
    del big
    return (1 << 30) / seconds / 1e9


def run_model(rounds: int, layers: int, new_tokens: int = 64) -> dict[str, Any]:
    from stoker import LLM, SamplingParams
    from stoker.roofline.modelspec import spec_from_config
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    moe_cfg = {**QWEN3_30B_A3B, "num_hidden_layers": layers}
    dense_cfg = {k: v for k, v in moe_cfg.items()
                 if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}
    dense_cfg["intermediate_size"] = QWEN3_30B_A3B["num_experts_per_tok"] * QWEN3_30B_A3B["moe_intermediate_size"]
    out: dict[str, Any] = {"layers": layers, "new_tokens": new_tokens, "models": {}}
    prompt = [{"prompt_token_ids": list(range(10, 26))}]
    with tempfile.TemporaryDirectory() as tmp:
        llms = {}
        for name, arch, cfg in (("qwen3-moe-30b-a3b-shaped", "qwen3_moe", moe_cfg), ("dense-llama-same-active", "llama", dense_cfg)):
            t0 = time.perf_counter()
            ckpt = make_tiny_checkpoint(Path(tmp) / name, arch, **cfg)
            llms[name] = LLM(str(ckpt), max_model_len=256, kv_cache_memory_bytes=64 << 20)
            spec = spec_from_config({**cfg, "model_type": "qwen3_moe" if arch == "qwen3_moe" else "llama"}, name)
            out["models"][name] = {"decode_weight_bytes": spec.decode_weight_bytes(1, "float32", "float32"),
                                   "active_params": spec.decode_weight_bytes(1, "float32", "float32") / 4,
                                   "tokens_per_s": []}
            print(f"  {name}: built and loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        bandwidth = []
        for _ in range(rounds):
            bandwidth.append(read_bandwidth_gbs())
            for name, llm in llms.items():
                def gen(n: int) -> float:
                    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                    t0 = time.perf_counter()
                    llm.generate(prompt, params, use_tqdm=False)
                    return time.perf_counter() - t0
                gen(new_tokens + 1)  # warm-up
                first = statistics.median(gen(1) for _ in range(3))
                whole = gen(new_tokens + 1)
                out["models"][name]["tokens_per_s"].append(new_tokens / (whole - first))
        out["read_bandwidth_gbs"] = bandwidth
        for m in out["models"].values():
            m["roofline_tokens_per_s"] = statistics.median(bandwidth) * 1e9 / m["decode_weight_bytes"]
        del llms
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("layer", "model", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the model part (2.4 GB each for the MoE)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's (and so the C kernels') threads; 1 keeps a loaded machine's other processes "
                             "from stalling every parallel region on its slowest thread")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from stoker.kernels.cpu import linear as cpu_linear

    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(), "isa": isa(),
        "kernel_build": cpu_linear.target(), "threads": torch.get_num_threads(), "rounds": args.rounds,
        "layer_shape": LAYER, "load_average_before": os.getloadavg(),
    }
    print(f"{report['cpu']} ({report['isa']}; C kernels built for {report['kernel_build']}), "
          f"{report['threads']} threads, {report['date']}, {args.rounds} rounds")
    if args.part in ("layer", "both"):
        report["layer_ms"], report["layer_fastest_ms"], report["layer_cpu_ms"] = run_layer(args.rounds)
        tables = [("median call", "layer_ms"), ("fastest call", "layer_fastest_ms")]
        if report["threads"] == 1:  # with more threads the process's CPU time sums them (and their spinning)
            tables.append(("median CPU time", "layer_cpu_ms"))
        for what, key in tables:
            layer = report[key]
            names = list(next(iter(layer.values())))
            print(f"\nOne layer's routed experts, ms per call: each round's {what}, median (min-max) of "
                  f"{args.rounds} rounds; E 8, top-2, H 1024, I 1536")
            print("| tokens | " + " | ".join(names) + " | torch-loop / c-one-call |")
            print("|---:|" + "---:|" * (len(names) + 1))
            for t, per in layer.items():
                ratio = statistics.median(per["torch-loop"]) / statistics.median(per["c-one-call"])
                print(f"| {t} | " + " | ".join(spread(per[n]) for n in names) + f" | {ratio:.2f}x |")
    if args.part in ("model", "both"):
        model = report["model"] = run_model(args.rounds, args.layers)
        bw = model["read_bandwidth_gbs"]
        print(f"\nDecode at batch 1, {model['layers']} layers, float32; read bandwidth {spread(bw)} GB/s")
        print("| model | weight bytes / token (MB) | tokens/s, median (min-max) | roofline tokens/s | of roofline |")
        print("|---|---:|---:|---:|---:|")
        for name, m in model["models"].items():
            tps = statistics.median(m["tokens_per_s"])
            print(f"| {name} | {m['decode_weight_bytes'] / 1e6:.0f} | {spread(m['tokens_per_s'])} | "
                  f"{m['roofline_tokens_per_s']:.1f} | {tps / m['roofline_tokens_per_s']:.0%} |")
    report["load_average_after"] = os.getloadavg()
    print(f"\nload average (1, 5, 15 min) before {report['load_average_before']}, after {report['load_average_after']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
