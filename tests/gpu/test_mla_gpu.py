"""Multi-head latent attention on CUDA: the compiled Triton absorbed decode against its twin
(bf16 and FP8 latent caches, DeepSeek-V3's 512 + 64 latent and 128 heads), and a DeepSeek-V3
engine whose layers bind it gives the greedy tokens of the same engine on the torch twins,
with a float32 and with an FP8 latent cache.

As tests/gpu/test_kernels_gpu.py: in a plain pytest process one test re-runs this file with
compiled Triton in a subprocess.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from paged_cases import assert_close, make_paged_batch  # noqa: E402

from stoker import LLM, SamplingParams  # noqa: E402
from stoker.kernels import reference  # noqa: E402
from tests.gpu.compiled import COMPILED, compiled_only, rerun_compiled  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.skipif(COMPILED, reason="this process already runs compiled kernels")
def test_compiled_mla_in_subprocess() -> None:
    rerun_compiled(__file__, timeout_s=900)


@compiled_only
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("context_lens, num_splits", [([1, 300, 2049, 77], None), ([5000], None), ([33, 64], 4)])
def test_mla_decode_kernel(context_lens: list[int], num_splits: int | None, fp8: bool) -> None:
    from stoker.kernels.mla_decode_attention import mla_decode_attention

    gen = torch.Generator().manual_seed(len(context_lens))
    b = make_paged_batch(context_lens, 1, 576, 64, torch.bfloat16, "cuda", gen)
    cache, k_scale = b.k_cache, 1.0
    if fp8:
        k_scale = 0.02
        cache = (b.k_cache.float() / k_scale).to(torch.float8_e4m3fn)
    q = (torch.randn(len(context_lens), 128, 576, generator=gen) * 0.3).to("cuda", torch.bfloat16)
    ctx = b.context_lens_tensor()
    out = mla_decode_attention(q, cache, b.block_tables, ctx, 512, 576**-0.5, k_scale, num_splits=num_splits)
    ref = reference.mla_decode_attention(q.float(), cache, b.block_tables, ctx, 512, 576**-0.5, k_scale)
    assert_close(out, ref, 2e-2, f"mla decode {context_lens} fp8={fp8}")


@compiled_only
def test_deepseek_v3_engine_binds_the_triton_kernel(tiny_checkpoints, monkeypatch) -> None:
    """float32 on the GPU: the Triton-bound engine's greedy tokens equal those of the same
    engine on the torch twins (STOKER_DISABLE_TRITON=1: only the kernels differ, by float32
    rounding); with an FP8 latent cache too."""
    from tests.model.test_mla import CONFIGS

    arch, overrides = CONFIGS["deepseek_v3"]
    path = str(tiny_checkpoints(arch, **overrides))
    prompts = [[0] + list(range(7, 7 + n)) for n in (3, 40, 130)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(kv: str, backend: str) -> list[list[int]]:
        llm = LLM(path, dtype="float32", device="cuda", max_model_len=256, kv_cache_memory_bytes=4 << 20,
                  kv_cache_dtype=kv)
        layers = llm.engine.executor.driver_runner.model.attention_layers()
        assert all(a.kernels.name == backend for a in layers)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.check_integrity()
        return [o.outputs[0].token_ids for o in outs]

    for kv in ("auto", "fp8"):
        got = run(kv, "triton")
        with monkeypatch.context() as m:
            m.setenv("STOKER_DISABLE_TRITON", "1")
            want = run(kv, "torch")
        assert got == want, kv
        torch.cuda.empty_cache()
