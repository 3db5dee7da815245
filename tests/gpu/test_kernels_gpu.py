"""The kernel checks of tests/kernels, compiled, in bf16, on a CUDA device; plus CUDA-graph capture.

Triton picks interpreter or compiler when a kernel is decorated, i.e. when its module is first
imported, and tests/conftest.py sets TRITON_INTERPRET=1 for the whole pytest process. So in a
normal `make test` process this file has one test, which re-runs this file in a subprocess with
TRITON_INTERPRET=0; there (or under `TRITON_INTERPRET=0 pytest -m gpu`) the real checks run.
Tolerances: bf16 keeps 8 significant bits, so one rounding of an O(1) value is ~4e-3; the
attention kernels also round P to bf16 before P @ V, hence 2e-2 against a float32 twin.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from paged_cases import assert_close, make_paged_batch, poisoned_like  # noqa: E402

from stoker.kernels import ops, reference  # noqa: E402
from tests.gpu.compiled import COMPILED, compiled_only, rerun_compiled  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16 = torch.bfloat16


@pytest.mark.skipif(COMPILED, reason="this process already runs compiled kernels")
def test_compiled_kernels_in_subprocess() -> None:
    rerun_compiled(__file__, timeout_s=900)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@compiled_only
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(1, 64, 16), (8, 128, 32)])
def test_store_kvcache(gen: torch.Generator, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    from stoker.kernels.store_kvcache import store_kvcache

    num_tokens, num_blocks = 300, 40
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to("cuda", BF16)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to("cuda", BF16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].cuda()
    slots[::7] = -1
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=BF16, device="cuda")
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    reference.store_kvcache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


@compiled_only
@pytest.mark.parametrize(
    "context_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, num_splits",
    [
        ([1, 17, 100, 1000], 32, 32, 64, 16, None, None),
        ([33, 64, 5, 2048], 32, 8, 128, 32, 512, None),
        ([4000, 300], 64, 8, 128, 16, None, 32),
        ([70, 9, 129] * 40, 32, 4, 128, 16, None, 1),
        ([45, 31], 28, 4, 128, 16, None, 2),  # group of 7 (Qwen2-7B)
    ],
)
def test_paged_decode_attention(
    gen: torch.Generator, context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, sliding_window: int | None, num_splits: int | None,
) -> None:
    from stoker.kernels.paged_decode_attention import paged_decode_attention

    b = make_paged_batch(context_lens, num_kv_heads, head_dim, block_size, BF16, "cuda", gen)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to("cuda", BF16)
    ctx = b.context_lens_tensor()
    scale = 1 / math.sqrt(head_dim)
    out = paged_decode_attention(
        q, b.k_cache, b.v_cache, b.block_tables, ctx, scale, sliding_window, out=poisoned_like(q), num_splits=num_splits
    )
    ref = reference.paged_decode_attention(q.float(), b.k_ref, b.v_ref, b.block_tables, ctx, scale, sliding_window)
    assert_close(out, ref, 2e-2, "decode bf16")


@compiled_only
@pytest.mark.parametrize(
    "seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window",
    [
        ([(9, 1), (400, 400), (777, 130), (1, 1), (33, 2)], 32, 32, 64, 16, None),
        ([(700, 700), (100, 1), (650, 300)], 32, 8, 128, 32, 256),
        ([(2048, 512), (300, 1), (1500, 1500)], 64, 8, 128, 16, None),
        ([(500, 500), (230, 50)], 28, 4, 128, 16, None),
    ],
)
def test_paged_attention(
    gen: torch.Generator, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, sliding_window: int | None,
) -> None:
    from stoker.kernels.paged_prefill_attention import paged_attention

    ctx = [c for c, _ in seqs]
    cu = [0]
    for _, q_len in seqs:
        cu.append(cu[-1] + q_len)
    b = make_paged_batch(ctx, num_kv_heads, head_dim, block_size, BF16, "cuda", gen)
    q = torch.randn(cu[-1], num_heads, head_dim, generator=gen).to("cuda", BF16)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(q, b.k_cache, b.v_cache, b.block_tables, cu, ctx, scale, sliding_window, out=poisoned_like(q))
    ref = reference.paged_attention(q.float(), b.k_ref, b.v_ref, b.block_tables, cu, ctx, scale, sliding_window)
    assert_close(out, ref, 2e-2, "prefill bf16")


@compiled_only
def test_soft_capped_attention_gemma2_shape(gen: torch.Generator) -> None:
    """Gemma 2 9B's attention (16 query heads over 8 KV heads of 256, query_pre_attn_scalar 224,
    a window, attn_logit_softcapping 50) with queries scaled so that scores reach the cap."""
    from stoker.kernels.paged_decode_attention import paged_decode_attention
    from stoker.kernels.paged_prefill_attention import paged_attention

    seqs, cap, window, scale = [(700, 700), (100, 1), (650, 300)], 50.0, 256, 224**-0.5
    ctx = [c for c, _ in seqs]
    cu = [0]
    for _, q_len in seqs:
        cu.append(cu[-1] + q_len)
    b = make_paged_batch(ctx, 8, 256, 16, BF16, "cuda", gen)
    q = (torch.randn(cu[-1], 16, 256, generator=gen) * 8).to("cuda", BF16)
    out = paged_attention(q, b.k_cache, b.v_cache, b.block_tables, cu, ctx, scale, window, out=poisoned_like(q),
                          logits_soft_cap=cap)
    ref = reference.paged_attention(q.float(), b.k_ref, b.v_ref, b.block_tables, cu, ctx, scale, window,
                                    logits_soft_cap=cap)
    assert_close(out, ref, 2e-2, "prefill bf16 soft cap")
    qd, lens = q[: len(ctx)].contiguous(), b.context_lens_tensor()
    out = paged_decode_attention(qd, b.k_cache, b.v_cache, b.block_tables, lens, scale, window, out=poisoned_like(qd),
                                 logits_soft_cap=cap)
    ref = reference.paged_decode_attention(qd.float(), b.k_ref, b.v_ref, b.block_tables, lens, scale, window,
                                           logits_soft_cap=cap)
    assert_close(out, ref, 2e-2, "decode bf16 soft cap")


@compiled_only
def test_norm_activation_rotary(gen: torch.Generator) -> None:
    from stoker.kernels.activation import silu_and_mul
    from stoker.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from stoker.kernels.rotary import rotary_embedding

    x = torch.randn(77, 4096, generator=gen).to("cuda", BF16)
    res = torch.randn(77, 4096, generator=gen).to("cuda", BF16)
    w = (1 + 0.1 * torch.randn(4096, generator=gen)).to("cuda", BF16)
    # Same roundings as the bf16 twin, but 1/rms differs in its last float32 bits (summation
    # order, rsqrt.approx), which can flip the bf16 rounding of x * rstd and then of w * that:
    # two bf16 ulps, and one ulp is at most 2^-7 of the largest |value|.
    assert_close(rms_norm(x, w, 1e-5, out=poisoned_like(x)), reference.rms_norm(x, w, 1e-5), 2**-6, "rms_norm")
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    assert_close(normed, ref_normed, 2**-6, "fused_add_rms_norm")

    gate_up = torch.randn(77, 2 * 14336, generator=gen).to("cuda", BF16)
    assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up.float()), 2**-7, "silu_and_mul")

    positions = torch.randint(0, 8192, (77,), generator=gen).cuda()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    freqs = torch.arange(8192, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), -1).cuda()
    q = torch.randn(77, 32, 128, generator=gen).to("cuda", BF16)
    k = torch.randn(77, 8, 128, generator=gen).to("cuda", BF16)
    q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q.float(), k.float(), cache)
    assert_close(q_out, q_ref, 2**-7, "rotary q")
    assert_close(k_out, k_ref, 2**-7, "rotary k")


@compiled_only
def test_ops_dispatch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 256, device="cuda", dtype=BF16)
    assert ops.use_triton(x)
    monkeypatch.setenv("STOKER_DISABLE_TRITON", "1")
    assert not ops.use_triton(x)
    assert torch.equal(ops.silu_and_mul(x), reference.silu_and_mul(x))


@compiled_only
def test_decode_step_kernels_capture_in_a_cuda_graph(gen: torch.Generator) -> None:
    """No launcher on the decode path syncs with the host: capture once, replay with new lengths."""
    from stoker.kernels.paged_decode_attention import paged_decode_attention
    from stoker.kernels.store_kvcache import store_kvcache

    b = make_paged_batch([900, 40, 300, 5], 8, 128, 16, BF16, "cuda", gen)
    k_cache, v_cache = b.k_ref.to(BF16), b.v_ref.to(BF16)  # NaN-free: the graph writes new slots
    q = torch.randn(4, 32, 128, generator=gen).to("cuda", BF16)
    kv = torch.randn(4, 8, 128, generator=gen).to("cuda", BF16)
    ctx = b.context_lens_tensor()
    slots = torch.zeros(4, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)

    def step() -> None:
        store_kvcache(kv, kv, k_cache, v_cache, slots)
        paged_decode_attention(q, k_cache, v_cache, b.block_tables, ctx, 0.088, out=out, num_splits=8)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ctx.copy_(torch.tensor([899, 33, 300, 2], dtype=torch.int32))  # shorter contexts, same shapes
    positions = ctx - 1
    slots.copy_(b.block_tables[torch.arange(4, device="cuda"), positions // 16].long() * 16 + positions % 16)
    graph.replay()
    torch.cuda.synchronize()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = reference.paged_decode_attention(q.float(), k_ref.float(), v_ref.float(), b.block_tables, ctx, 0.088)
    assert_close(out, expected, 2e-2, "graph replay")
