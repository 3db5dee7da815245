"""Quantization on a CUDA device (issue 13), compiled Triton, bf16: the FP8 KV cache kernels,
the weight-only Triton GEMM and W8A8 through torch._scaled_mm against their twins, and the
engine with --quantization fp8 / int8 and --kv-cache-dtype fp8 against the bf16 model (KL
bounds as tests/model/test_online_quantization.py, CUDA graphs on). Not yet run on a GPU
(docs/benchmarks.md, "GPU (Triton) kernels: not yet measured")."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from paged_cases import assert_close, make_paged_batch, poisoned_like  # noqa: E402

from stoker.kernels import reference  # noqa: E402
from stoker.quantization import formats  # noqa: E402
from tests.gpu.compiled import COMPILED, compiled_only, rerun_compiled  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FP8 = torch.float8_e4m3fn


@pytest.mark.skipif(COMPILED, reason="this process already runs compiled kernels")
def test_compiled_quantization_in_subprocess() -> None:
    rerun_compiled(__file__, timeout_s=900)


@compiled_only
def test_fp8_store_writes_the_twins_bytes() -> None:
    from stoker.kernels.store_kvcache import store_kvcache

    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(300, 8, 128, generator=gen) * 30).to("cuda", torch.bfloat16)
    value = (torch.randn(300, 8, 128, generator=gen) * 0.01).to("cuda", torch.bfloat16)
    slots = torch.randperm(40 * 16, generator=gen)[:300].cuda()
    caches = [torch.zeros(40, 16, 8, 128, dtype=FP8, device="cuda") for _ in range(4)]
    store_kvcache(key, value, caches[0], caches[1], slots, 0.05, 0.002)
    reference.store_kvcache(key, value, caches[2], caches[3], slots, 0.05, 0.002)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@compiled_only
def test_fp8_cache_attention() -> None:
    from stoker.kernels.paged_decode_attention import paged_decode_attention
    from stoker.kernels.paged_prefill_attention import paged_attention

    gen = torch.Generator().manual_seed(1)
    b = make_paged_batch([1, 100, 1000, 37], 8, 128, 16, torch.float32, "cuda", gen)
    k8, v8 = (b.k_cache / 0.02).to(FP8), (b.v_cache / 0.3).to(FP8)
    k_ref, v_ref = torch.nan_to_num(k8.float() * 0.02), torch.nan_to_num(v8.float() * 0.3)
    q = torch.randn(4, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    lens = b.context_lens_tensor()
    out = paged_decode_attention(q, k8, v8, b.block_tables, lens, 1 / math.sqrt(128), None, out=poisoned_like(q), k_scale=0.02, v_scale=0.3)
    ref = reference.paged_decode_attention(q.float(), k_ref, v_ref, b.block_tables, lens, 1 / math.sqrt(128))
    assert_close(out, ref, 2e-2, "decode fp8 cache")
    cu = [0, 1, 51, 51 + 200, 51 + 200 + 37]
    qp = torch.randn(cu[-1], 32, 128, generator=gen).to("cuda", torch.bfloat16)
    ctx = [1, 100, 1000, 37]
    out = paged_attention(qp, k8, v8, b.block_tables, cu, ctx, 0.088, None, out=poisoned_like(qp), k_scale=0.02, v_scale=0.3)
    ref = reference.paged_attention(qp.float(), k_ref, v_ref, b.block_tables, cu, ctx, 0.088)
    assert_close(out, ref, 2e-2, "prefill fp8 cache")


@compiled_only
@pytest.mark.parametrize("dtype, group_k", [("int8", 4096), ("fp8", 128)])
@pytest.mark.parametrize("rows", [1, 64, 512])
def test_w8_linear(dtype: str, group_k: int, rows: int) -> None:
    from stoker.kernels.w8_linear import w8_linear

    gen = torch.Generator().manual_seed(2)
    q, _ = formats.quantize_rows(torch.randn(1024, 4096, generator=gen), dtype)
    s = (torch.rand(1024, 4096 // group_k, generator=gen) * 0.01).cuda()
    q = q.cuda()
    x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
    out = w8_linear(x, q, s, group_k)
    ref = reference.w8_linear(x.float(), q, s, group_k)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@compiled_only
@pytest.mark.parametrize("dtype, n, k, group_k", [("int8", 6144, 4096, 4096), ("fp8", 1024, 4096, 4096), ("fp8", 4096, 14336, 128),
                                                  ("int8", 28672, 4096, 4096)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_w8(dtype: str, n: int, k: int, group_k: int, rows: int) -> None:
    """The decode GEMV (quant_gemv.gemv_w8) in bf16 against its twin and the w8_linear twin;
    every element of a NaN-poisoned output written."""
    from stoker.kernels.quant_gemv import gemv_w8

    gen = torch.Generator().manual_seed(5)
    q, s = formats.quantize_rows(torch.randn(n, k, generator=gen), dtype)
    if group_k < k:
        s = torch.rand(n, k // group_k, generator=gen) * 0.01 + 1e-3
    q, s = q.cuda(), s.cuda()
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    out = gemv_w8(x, q, s, group_k, bias, out=torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda"))
    assert not out.isnan().any()
    assert rel_err(out, reference.gemv_w8(x, q, s, group_k, bias)) < 5e-3
    assert rel_err(out, reference.w8_linear(x.float(), q, s, group_k, bias)) < 1e-2
    assert torch.equal(out[:1], gemv_w8(x[:1], q, s, group_k, bias))  # a row's result does not depend on its batch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@compiled_only
def test_scaled_mm_backend_is_chosen_on_fp8_gpus(tiny_checkpoints) -> None:
    from stoker import LLM
    from stoker.models.method_chooser import fp8_matmul_supported
    from stoker.layers.linear import Linear
    from stoker.layers.quantized_method import QuantizedLinearMethod

    llm = LLM(str(tiny_checkpoints("llama")), quantization="fp8", kv_cache_memory_bytes=32 << 20)
    backends = {m.method.backend for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, Linear) and isinstance(m.method, QuantizedLinearMethod)}
    assert backends == ({"scaled_mm"} if fp8_matmul_supported(torch.device("cuda")) else {"triton_w8"})


@compiled_only
@pytest.mark.parametrize("quantization, kv, max_kl", [("int8", "auto", 2e-3), ("fp8", "auto", 2e-2), (None, "fp8", 5e-3), ("fp8", "fp8", 3e-2)])
def test_engine_stays_close_to_bf16(tiny_checkpoints, quantization, kv, max_kl) -> None:
    """Teacher-forced next-token distributions over 256 positions against the bf16 engine:
    mean KL below the bound, 4-5x the CPU float32 ones (bf16 activations add their own rounding)."""
    from stoker import LLM
    from tests.model.helpers import engine_logits

    path = tiny_checkpoints("llama")
    rng = random.Random(0)
    ids = [0] + [rng.randrange(5, 1000) for _ in range(255)]
    ref = engine_logits(LLM(str(path), kv_cache_memory_bytes=32 << 20), ids).float()
    out = engine_logits(LLM(str(path), kv_cache_memory_bytes=32 << 20, quantization=quantization, kv_cache_dtype=kv), ids).float()
    lp, lq = ref.log_softmax(-1), out.log_softmax(-1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
    assert 0 < kl < max_kl
