"""MLA on CPU (issue 37): decode tokens/s of a DeepSeek-V2-Lite-shaped model with absorbed
decode through the C kernel (what the engine runs on CPU), through its torch twin, and expanded
decode (the latent expanded to per-head K/V every step, as prefill does), and absorbed decode
through the C kernel over an FP8 latent cache (`--kv-cache-dtype fp8`, a second engine), same
process, in turn each round (the order reversed every round); and the KV capacity of the latent
cache at the same memory against an MHA-sized cache of the same heads, float32 and FP8.

    nice -n 5 python benchmarks/mla_decode_cpu.py [--rounds 3] [--context 128] [--json out.json]
        [--modes absorbed-c,absorbed-c-fp8]   (a subset of the peers; all four by default)

Model: V2-Lite's attention exactly (hidden 2048, 16 heads, q_lora_rank null, kv_lora_rank 512,
qk_nope 128 + qk_rope 64, v 128; config_16B.json of DeepSeek's inference code), with 2 layers
(the first dense, intermediate 10944), 8 routed experts of 1408 (V2-Lite: 64), 6 per token,
2 shared, vocab 1024; random weights, float32. Decode tokens/s = batch / the median wall time of
the runner's pure-decode steps (every sequence one new token; timed around `execute`), at batch
1 and 32, prompts of `--context` distinct tokens, `--steps` decode steps per run.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

V2_LITE_SHAPE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                     kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     intermediate_size=10944, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
                     moe_intermediate_size=1408, num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy",
                     max_position_embeddings=4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--modes", default="absorbed-c,absorbed-torch,expanded,absorbed-c-fp8")
    args = ap.parse_args()

    from stoker import LLM, SamplingParams
    from stoker.kernels import ops
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "v2lite", "deepseek_v2", **V2_LITE_SHAPE)
        budget = 256 << 20
        llms = {kv: LLM(str(path), max_model_len=1024, kv_cache_memory_bytes=budget, max_num_seqs=32, kv_cache_dtype=kv)
                for kv in ("auto", "fp8")}
        llm, runner = llms["auto"], llms["auto"].engine.executor.driver_runner
        rng = random.Random(0)
        step_times: list[float] = []

        def timed(execute):
            def timed_execute(message, *a, **kw):  # records the wall time of pure-decode steps
                t0 = time.perf_counter()
                out = execute(message, *a, **kw)
                if message.seqs and all(s.num_tokens == 1 for s in message.seqs):
                    step_times.append(time.perf_counter() - t0)
                return out
            return timed_execute

        for engine in llms.values():
            engine.engine.executor.driver_runner.execute = timed(engine.engine.executor.driver_runner.execute)
        results: dict[str, list[float]] = {}
        # (label, engine, decode absorbed, the kernel set the layers run: C kernel or torch twin)
        modes = [("absorbed-c", "auto", True, ops.CPU), ("absorbed-torch", "auto", True, ops.TORCH),
                 ("expanded", "auto", False, ops.CPU), ("absorbed-c-fp8", "fp8", True, ops.CPU)]
        modes = [m for m in modes if m[0] in args.modes.split(",")]
        for round_index in range(args.rounds):
            if round_index:  # each round the other order: no peer always runs right after another
                modes.reverse()
            for batch in (1, 32):
                prompts = [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(args.context)]}
                           for _ in range(batch)]
                for mode, kv, absorbed, kernels in modes:
                    for layer in llms[kv].engine.executor.driver_runner.model.attention_layers():
                        layer.absorbed_decode, layer.kernels = absorbed, kernels
                    step_times.clear()
                    params = SamplingParams(temperature=0, max_tokens=1 + args.steps, ignore_eos=True)
                    llms[kv].generate(prompts, params, use_tqdm=False)
                    results.setdefault(f"{mode} batch {batch}", []).append(batch / statistics.median(step_times))
        for engine in llms.values():
            for layer in engine.engine.executor.driver_runner.model.attention_layers():
                layer.absorbed_decode, layer.kernels = True, ops.CPU
        spec = runner.kv_spec
        mha_bytes = spec.num_layers * 16 * (192 + 128) * 4  # K 192 + V 128 per head, float32
        report = {
            "decode_tokens_per_s": {k: statistics.median(v) for k, v in results.items()},
            "decode_tokens_per_s_rounds": results,
            "context": args.context, "steps": args.steps, "rounds": args.rounds,
            "kv_bytes_per_token_latent": spec.bytes_per_token,
            "kv_bytes_per_token_latent_fp8": llms["fp8"].engine.executor.driver_runner.kv_spec.bytes_per_token,
            "engine_num_blocks_fp8": llms["fp8"].engine.block_manager.num_free_blocks,
            "kv_bytes_per_token_mha": mha_bytes,
            "kv_tokens_latent_at_256MiB": runner.config.cache_config.kv_cache_memory_bytes // spec.bytes_per_token
            if runner.config.cache_config.kv_cache_memory_bytes else None,
            "kv_tokens_mha_at_256MiB": budget // mha_bytes,
            "engine_num_blocks": llm.engine.block_manager.num_free_blocks,
        }
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
