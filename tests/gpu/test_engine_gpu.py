"""The engine-core model tests on CUDA, and decode CUDA graphs against eager.

* prefill logits in bf16 within bf16 tolerance of HF transformers in bf16 on the same GPU;
* greedy output of a mixed batch (chunked prefill, prefix hits, preemption) in float32 equal
  to HF's float32 greedy path, on CUDA, with the decode graphs on;
* CUDA-graph replay equal to eager: the same greedy tokens (float32, batches shrinking through
  several buckets) and one decode step's logits within bf16 tolerance;
* dtype="auto" is bfloat16 on CUDA.

Like tests/gpu/test_kernels_gpu.py: tests/conftest.py sets TRITON_INTERPRET=1, and an
interpreted kernel copies through the host (no graphs, and slow). So in a plain `pytest`
process this file runs one test that re-runs it in a subprocess with TRITON_INTERPRET=0;
`make test-gpu` (TRITON_INTERPRET=0 pytest -m gpu tests/gpu) runs the checks directly.
Every engine caps its KV cache (kv_cache_memory_bytes / num_gpu_blocks_override), so that
several engines fit at once and none profiles 90% of the GPU for a tiny model.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from stoker import LLM, SamplingParams
from tests.gpu.compiled import COMPILED, compiled_only, rerun_compiled
from tests.model.helpers import engine_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ARCHS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", dict(head_dim=32))}
KV_BYTES = 32 << 20


@pytest.mark.skipif(COMPILED, reason="this process already runs compiled kernels")
def test_compiled_engine_in_subprocess() -> None:
    rerun_compiled(__file__, timeout_s=1500)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """As tests/model/test_models_vs_hf.py: lengths 1 to 300, and shared 48-token prefixes."""
    rng = random.Random(0)
    shared = [rng.randrange(5, 1000) for _ in range(48)]
    ps = [[0]]
    for n in (3, 17, 40, 95, 180, 300):
        ps.append([0] + [rng.randrange(5, 1000) for _ in range(n - 1)])
    ps += [shared + [rng.randrange(5, 1000) for _ in range(k)] for k in (1, 9, 33)]
    ps.append(list(shared))
    return ps


def _load_hf_cuda(path: Path, dtype: torch.dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


@torch.no_grad()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], device="cuda")).logits[0].float()


@torch.no_grad()
def _hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([ids], device="cuda")
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens
    )
    return out[0, len(ids) :].tolist()


def _count_replays(llm: LLM) -> list[int]:
    """Wrap the graph runner's `run` to record each replayed step's batch size."""
    graph_runner = llm.engine.executor.driver_runner.graph_runner
    assert graph_runner is not None, "graphs were not captured"
    sizes: list[int] = []
    run = graph_runner.run

    def counted(input_ids, positions, md):
        sizes.append(input_ids.shape[0])
        return run(input_ids, positions, md)

    graph_runner.run = counted
    return sizes


@compiled_only
def test_dtype_auto_is_bfloat16_and_graphs_follow_enforce_eager(tiny_llama, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="stoker.runner.cuda_graph"):
        llm = LLM(str(tiny_llama), device="cuda", max_model_len=256, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=40)
    runner = llm.engine.executor.driver_runner
    assert runner.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert runner.kv_caches[0][0].dtype == runner.dtype
    assert runner.graph_runner is not None
    assert sorted(runner.graph_runner.graphs) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert "captured 8 CUDA graphs in" in caplog.text
    assert LLM(str(tiny_llama), dtype="float16", device="cuda", max_model_len=256, kv_cache_memory_bytes=KV_BYTES,
               enforce_eager=True).engine.executor.driver_runner.dtype == torch.float16
    eager = LLM(str(tiny_llama), device="cuda", max_model_len=256, kv_cache_memory_bytes=KV_BYTES, enforce_eager=True)
    assert eager.engine.executor.driver_runner.graph_runner is None


@compiled_only
@pytest.mark.parametrize("name", list(ARCHS))
def test_prefill_logits_bf16_match_hf_bf16(name, tiny_checkpoints, prompts) -> None:
    """bf16 keeps 8 significant bits: one rounding of the largest logit (|x| ~ 6 here) is
    2^-7 |x|. Two bounds: within 4 such units of HF-in-bf16, and no more than 3x as far from
    HF-in-float32 as HF-in-bf16 itself is."""
    arch, overrides = ARCHS[name]
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=512, kv_cache_memory_bytes=KV_BYTES, enforce_eager=True)
    hf16, hf32 = _load_hf_cuda(path, torch.bfloat16), _load_hf_cuda(path, torch.float32)
    for ids in (prompts[5], prompts[6]):
        ours, ref16, ref32 = engine_logits(llm, ids).float(), _hf_logits(hf16, ids), _hf_logits(hf32, ids)
        unit = 2**-7 * ref32.abs().max().item()
        assert (ours - ref16).abs().max().item() <= 4 * unit, f"{name}: length {len(ids)}"
        hf_err = (ref16 - ref32).abs().max().item()
        assert (ours - ref32).abs().max().item() <= 3 * hf_err + unit, f"{name}: length {len(ids)}"


@compiled_only
@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_mixed_batch_float32_matches_hf(name, tiny_checkpoints, prompts) -> None:
    """tests/model's mixed-batch check on CUDA, graphs on: 40 blocks x 16 tokens for ~1100
    prompt tokens forces preemption, a 64-token budget forces chunked prefill."""
    arch, overrides = ARCHS[name]
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=512, block_size=16,
              num_gpu_blocks_override=40, max_num_batched_tokens=64)
    replays = _count_replays(llm)
    max_new = 12
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test should force preemption"
    assert llm.engine.block_manager.prefix_cache_hits > 0, "the test should hit the prefix cache"
    assert replays, "some decode steps should replay a graph"
    hf = _load_hf_cuda(path, torch.float32)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, max_new), f"{name}: prompt of length {len(ids)}"
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == 40


@compiled_only
@pytest.mark.parametrize("name", list(ARCHS))
def test_graph_replay_greedy_equals_eager(name, tiny_checkpoints) -> None:
    """13 sequences finishing one by one: decode batches 13..1 replay buckets 16, 8, 4, 2, 1
    (with padding rows) and must give eager's tokens exactly (float32)."""
    arch, overrides = ARCHS[name]
    path = tiny_checkpoints(arch, **overrides)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(5 + 11 * i)]} for i in range(13)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(13)]
    kwargs = dict(dtype="float32", device="cuda", max_model_len=512, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=32)
    eager = LLM(str(path), enforce_eager=True, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), **kwargs)
    replays = _count_replays(llm)
    graphed = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    assert set(replays) >= {13, 8, 4, 2, 1}, sorted(set(replays))
    llm.engine.check_integrity()


@compiled_only
@pytest.mark.parametrize("name", list(ARCHS))
def test_graph_replay_decode_logits_equal_eager_bf16(name, tiny_checkpoints) -> None:
    """The first decode step's logits (5 sequences, bucket 8) with graphs vs eager, bf16.

    Prefill is eager in both, so the decode inputs are identical; the two forwards differ
    only in the decode kernel's split count (the graph's block tables span max_model_len)."""
    arch, overrides = ARCHS[name]
    path = tiny_checkpoints(arch, **overrides)
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(n)]} for n in (1, 30, 77, 200, 333)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def decode_logits(enforce_eager: bool) -> torch.Tensor:
        llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=512, kv_cache_memory_bytes=KV_BYTES,
                  enforce_eager=enforce_eager)
        model = llm.engine.executor.driver_runner.model
        recorded: list[torch.Tensor] = []
        compute = model.compute_logits

        def record(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute(hidden)
            recorded.append(logits.clone())
            return logits

        model.compute_logits = record
        replays = None if enforce_eager else _count_replays(llm)
        llm.generate(prompts, params, use_tqdm=False)
        assert len(recorded) == 2, "one prefill step then one decode step"
        assert replays in (None, [5])
        return recorded[1]

    graphed, eager = decode_logits(False), decode_logits(True)
    assert graphed.shape == eager.shape == (5, graphed.shape[1])
    unit = 2**-7 * eager.abs().max().item()
    assert (graphed - eager).abs().max().item() <= 4 * unit


@compiled_only
def test_ngram_speculative_decoding_greedy_equals_none_on_cuda(tiny_llama) -> None:
    """Verify steps run the drafts through the varlen paged-attention kernel (a 1 + k token chunk
    per sequence) while decode-only steps replay graphs; float32 greedy output must equal the
    engine without drafts, and drafts must have been accepted (a fixed k: every step verifies)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
            "dynamic": False}
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11] * 6}, {"prompt_token_ids": list(range(40, 75))},
               {"prompt_token_ids": [300, 301, 302] * 10 + [7, 8]}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_model_len=256, kv_cache_memory_bytes=KV_BYTES)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama), speculative_config=spec, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0
    llm.engine.check_integrity()
