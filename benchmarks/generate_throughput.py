"""Stoker's offline throughput alone, on throughput_vs_hf.py's workload: for before/after runs.

throughput_vs_hf.py times HF's peers in the same process, which takes minutes per run and adds
their noise; comparing two checkouts of Stoker needs only Stoker's side, run often:

    .venv/bin/python benchmarks/ab_checkouts.py --a /tmp/before --b . --rounds 5 --script-from here \\
        --metric median -- benchmarks/generate_throughput.py

The model (throughput_vs_hf.MODEL's shape, random weights, fixed seed, built with transformers so
either checkout reads the same files) and the 64 requests (prompts of 32-256 tokens, 16-128 output
tokens, greedy, ignore_eos) are the same for every checkout; each timed run starts from an empty
prefix cache. Prints output tokens/s, the median of --repeats runs; --json keeps them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024)
TOKENIZER = Path(__file__).resolve().parents[1] / "stoker" / "assets" / "demo_tokenizer"


def make_checkpoint(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(TOKENIZER).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from stoker import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(rng.randint(32, 256))]} for _ in range(64)]
    params = [SamplingParams(max_tokens=rng.randint(16, 128), ignore_eos=True, temperature=0) for _ in range(64)]
    with tempfile.TemporaryDirectory(prefix="stoker-gen-tput-") as tmp:
        make_checkpoint(Path(tmp))
        llm = LLM(tmp, max_model_len=512, kv_cache_memory_bytes=512 << 20)
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up: kernels built, shapes seen
        rates = []
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    result = {"median": statistics.median(rates), "runs": rates}
    print(f"output tokens/s: median {result['median']:.1f} of {[round(r, 1) for r in rates]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
