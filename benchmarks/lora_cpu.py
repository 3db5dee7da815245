"""Multi-LoRA's cost: offline throughput with every request on one of 4 rank-16 adapters vs the
base model alone, same run, and the roofline's account of the adapters' extra bytes and FLOPs.

    python benchmarks/lora_cpu.py                 # issue 2's workload, 3 rounds, medians
    python benchmarks/lora_cpu.py --rounds 5 --json out.json

Workload (issue 2's): a Llama-shaped random checkpoint (hidden 512, intermediate 1408, 8 layers,
8 heads / 4 KV heads, vocab 1024), 64 requests, prompt lengths uniform in [32, 256], output
lengths uniform in [16, 128], ignore_eos, greedy, float32 on CPU. Three engines, run in turn
each round (the peers side by side on this noisy machine):
  base      LoRA off (the reference);
  lora-off  --enable-lora, every request on the base model (what enabling LoRA costs by itself);
  lora-4    --enable-lora --max-loras 4, request i on adapter i % 4 (rank 16, all projections).
Target (issue 17): lora-4 at least 80% of base's output tokens/s.

Roofline: per step, each adapter present adds, per target projection, r x (in + out) weights
to read and 2 x r x (in + out) FLOPs per token of its rows; printed beside the base's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model, isa  # noqa: E402
from stoker import LLM, LoRARequest, SamplingParams  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

ISSUE2_SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 4, "max_position_embeddings": 2048}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, n: int, rank: int) -> list[Path]:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    out = []
    for i in range(n):
        torch.manual_seed(100 + i)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.data.normal_(0, 0.05)
        peft_model.save_pretrained(str(root / f"a{i}"))
        out.append(root / f"a{i}")
    return out


def workload(seed: int, vocab: int) -> tuple[list[dict[str, Any]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(64):
        prompts.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))]})
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(16, 128), ignore_eos=True))
    return prompts, params


def run(llm: LLM, prompts: list, params: list, loras: list | None) -> float:
    """Output tokens/s of the whole workload."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def roofline(rank: int, num_adapters: int) -> dict[str, float]:
    from stoker.roofline.lora import LoRACost, LoRASpec
    from stoker.roofline.modelspec import dtype_bytes, spec_from_config

    cfg = {**ISSUE2_SHAPE, "vocab_size": 1024, "architectures": ["LlamaForCausalLM"]}
    m = spec_from_config(cfg, "issue2")
    # the roofline's account (roofline/lora.py): a step of num_adapters sequences, each on its own
    # adapter targeting all seven projections (TARGETS), float32 like the engine here
    lora = LoRACost.of(m, LoRASpec(rank, num_adapters, tuple(TARGETS)), seqs=num_adapters, act_dtype="fp32")
    base_params = m.num_params
    return {"adapter_params": round(lora.params_per_adapter), "base_params": base_params,
            "extra_bytes_per_step_share": lora.weight_bytes / (base_params * dtype_bytes("fp32")),
            "extra_flops_per_token_share": lora.flops_per_token / (2 * base_params)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_checkpoint(root / "m", "llama", **ISSUE2_SHAPE)
        adapters = make_adapters(base, root, 4, args.rank)
        vocab = json.loads((base / "config.json").read_text())["vocab_size"]
        prompts, params = workload(0, vocab)
        loras = [LoRARequest(f"a{i % 4}", i % 4 + 1, str(adapters[i % 4])) for i in range(len(prompts))]
        kw = dict(max_model_len=512, kv_cache_memory_bytes=256 << 20, max_num_seqs=64)
        engines = {"base": LLM(str(base), **kw),
                   "lora-off": LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **kw),
                   "lora-4": LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **kw)}
        for name, llm in engines.items():  # warm-up (and the adapters read in)
            run(llm, prompts[:4], params[:4], loras[:4] if name == "lora-4" else None)
        results: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, llm in engines.items():
                results[name].append(run(llm, prompts, params, loras if name == "lora-4" else None))
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in results.items()), flush=True)
    med = {n: statistics.median(v) for n, v in results.items()}
    # the peers ran side by side in each round: the median of the per-round ratios is the figure
    # least moved by a burst of load landing on one engine's turn
    ratio = {n: statistics.median(a / b for a, b in zip(v, results["base"])) for n, v in results.items()}
    roof = roofline(args.rank, 4)
    print(f"\nmachine: {cpu_model()} ({isa()}); rounds {args.rounds}, medians of output tokens/s")
    print(f"{'engine':<10} {'tok/s':>8} {'vs base (median of round ratios)':>34}")
    for n, v in med.items():
        print(f"{n:<10} {v:>8.1f} {ratio[n]:>34.2f}")
    print(f"\nroofline: one rank-{args.rank} adapter on all projections = {roof['adapter_params']:,} params "
          f"({100 * roof['extra_flops_per_token_share']:.1f}% of the base's {roof['base_params']:,}); a step with "
          f"4 adapters reads {100 * roof['extra_bytes_per_step_share']:.1f}% more weight bytes, each token "
          f"does {100 * roof['extra_flops_per_token_share']:.1f}% more FLOPs")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "medians": med, "ratios": ratio, "roofline": roof},
                                              indent=2))


if __name__ == "__main__":
    main()
