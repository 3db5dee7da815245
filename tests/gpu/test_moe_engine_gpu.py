"""Mixture-of-Experts models on CUDA: the experts run the Triton fused-MoE kernel and the decode
CUDA graphs hold it.

* the chooser gives every FusedMoE `TritonMoEMethod` (float) or the quantized method's `triton`
  backend (`--quantization fp8|int8`), and the runner captures its decode graphs;
* greedy output of a mixed batch (chunked prefill, prefix hits, preemption) in float32 equal to
  HF transformers' float32 greedy path on the same GPU, graphs on;
* graph replay gives eager's tokens (float32).

As tests/gpu/test_engine_gpu.py: in a plain pytest process one test re-runs this file with
compiled Triton in a subprocess.
"""

from __future__ import annotations

import random

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.moe import FusedMoE
from tests.gpu.compiled import COMPILED, compiled_only, rerun_compiled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIGS = {  # as tests/model/test_moe_families.py
    "qwen3_moe": ("qwen3_moe", dict(num_experts_per_tok=2, num_experts=8, moe_intermediate_size=32, head_dim=16,
                                    norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(num_experts_per_tok=2, num_local_experts=8, intermediate_size=32)),
}


@pytest.mark.skipif(COMPILED, reason="this process already runs compiled kernels")
def test_compiled_moe_engine_in_subprocess() -> None:
    rerun_compiled(__file__, timeout_s=1200)


def moe_methods(llm: LLM) -> list:
    return [m.method for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, FusedMoE)]


@compiled_only
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_mixed_batch_float32_matches_hf_with_graphs(name, tiny_checkpoints) -> None:
    import transformers

    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=512, block_size=16,
              num_gpu_blocks_override=40, max_num_batched_tokens=64)
    methods = moe_methods(llm)
    assert methods and all(type(m).__name__ == "TritonMoEMethod" for m in methods)
    assert llm.engine.executor.driver_runner.graph_runner is not None, "MoE decode should be captured"
    rng = random.Random(1)
    shared = [rng.randrange(5, 1000) for _ in range(32)]
    prompts = [[0]] + [[0] + [rng.randrange(5, 1000) for _ in range(n - 1)] for n in (3, 17, 40, 95, 180)]
    prompts += [shared + [rng.randrange(5, 1000) for _ in range(k)] for k in (1, 9, 21)]
    max_new = 12
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 2
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, min_new_tokens=max_new,
                              do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, f"{name}: prompt of length {len(ids)}"
    llm.engine.check_integrity()


@compiled_only
@pytest.mark.parametrize("name", list(CONFIGS))
def test_graph_replay_greedy_equals_eager(name, tiny_checkpoints) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(5 + 11 * i)]} for i in range(13)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(13)]
    kwargs = dict(dtype="float32", device="cuda", max_model_len=512, kv_cache_memory_bytes=32 << 20, max_num_seqs=32)
    eager = LLM(str(path), enforce_eager=True, **kwargs).generate(prompts, params, use_tqdm=False)
    graphed = LLM(str(path), **kwargs).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


@compiled_only
@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_online_quantized_experts_run_the_kernel_in_graphs(quantization: str, tiny_checkpoints) -> None:
    arch, overrides = CONFIGS["qwen3_moe"]
    llm = LLM(str(tiny_checkpoints(arch, **overrides)), quantization=quantization, dtype="bfloat16", device="cuda",
              max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=8)
    methods = moe_methods(llm)
    assert methods and all(m.backend == "triton" and m.graph_capturable for m in methods)
    assert llm.engine.executor.driver_runner.graph_runner is not None
    out = llm.generate([{"prompt_token_ids": [0, 5, 17, 300]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
