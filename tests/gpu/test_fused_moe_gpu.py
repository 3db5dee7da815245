"""The Triton fused-MoE kernel compiled on a CUDA device against its twin (reference.fused_moe_grouped),
float and 8-bit experts, and inside a CUDA graph with a routing that changes between replays.

As tests/gpu/test_kernels_gpu.py: under the suite's TRITON_INTERPRET=1 this file has one test
that re-runs it with compiled Triton in a subprocess. Tolerance (||out - twin|| / ||twin||):
bfloat16 5e-3, the twin's roundings but tensor-core sums in another order, which may move a
bf16 intermediate to its neighbour (~4e-3 relative each); float32 1e-3 (the kernel runs
float32 operands with "ieee" products, the twin's matmul may use TF32 on the GPU: allow it).
The sm_90 spill check needs no GPU: tests/kernels/test_kernel_compile_sm90.py.
"""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import reference
from stoker.layers.moe_router import softmax_topk
from stoker.quantization import formats
from tests.gpu.compiled import COMPILED, compiled_only, rerun_compiled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.bfloat16: 5e-3, torch.float32: 1e-3}


@pytest.mark.skipif(COMPILED, reason="this process already runs compiled kernels")
def test_compiled_fused_moe_in_subprocess() -> None:
    rerun_compiled(__file__, timeout_s=600)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def case(num_experts: int, k: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to("cuda", dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to("cuda", dtype)
    x = torch.randn(num_tokens, hidden, generator=gen).to("cuda", dtype)
    weights, ids = softmax_topk(torch.randn(num_tokens, num_experts, generator=gen).cuda(), k, renormalize=True)
    return x, w13, w2, weights, ids


@compiled_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens",
                         [(8, 2, 4096, 1024, 1), (8, 2, 1024, 768, 128), (1, 1, 520, 136, 33), (16, 16, 256, 200, 7),
                          (128, 8, 512, 256, 300)])
def test_matches_the_twin(num_experts, k, hidden, inter, num_tokens, dtype) -> None:
    from stoker.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = case(num_experts, k, hidden, inter, num_tokens, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert rel_err(out, reference.fused_moe_grouped(x, w13, w2, weights, ids)) < TOL[dtype]


@compiled_only
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("block", [None, 128], ids=["per-channel", "blocks-128"])
def test_8bit_experts_match_the_twin(qdtype: str, block: int | None) -> None:
    from stoker.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = case(8, 2, 1024, 768, 64, torch.bfloat16)

    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:  # (E, N, K) -> q, (E, N, G), group_k
        if block is None:
            qs = [formats.quantize_rows(we, qdtype) for we in w.float()]
            return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs]), w.shape[2]
        e, n, kk = w.shape
        blocks = w.float().abs().reshape(e, n // block, block, kk // block, block).amax(dim=(2, 4))
        blocks = blocks / (formats.FP8_MAX if qdtype == "fp8" else formats.INT8_MAX)
        rows = blocks.repeat_interleave(block, dim=1)  # (E, N, G): formats.scale_rows's layout
        q = formats.quantize_with(w.float(), rows.repeat_interleave(block, dim=2), qdtype)
        return q, rows.contiguous(), block

    q13, s13, g13 = quantize(w13)
    q2, s2, g2 = quantize(w2)
    out = fused_moe(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2)
    assert rel_err(out, reference.fused_moe_grouped(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2)) < TOL[torch.bfloat16]


@compiled_only
def test_captures_in_a_cuda_graph_and_follows_the_routing() -> None:
    """The alignment runs on the device: one captured graph serves any routing of its batch size."""
    from stoker.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = case(8, 2, 512, 384, 16, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        w_new, ids_new = softmax_topk(torch.randn(16, 8, generator=gen).cuda(), 2, renormalize=True)
        ids_new[:, 0] = 3  # a skewed routing: one expert takes every token
        ids_new[:, 1] = torch.where(ids_new[:, 1] == 3, 5, ids_new[:, 1])
        weights.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference.fused_moe_grouped(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]


# ---- the small-batch path (GEMV-style kernels, T <= SMALL_BATCH_TOKENS by default) ----------------------------
# Shapes: Mixtral-like decode (2 pairs); 16 pairs (the threshold) over 8 experts; the down GEMM's K
# split 8 ways (I 8192 at 2 pairs); odd H / I and k = E; Qwen3-MoE-like (128 experts, top-8, 1 token).


@compiled_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens",
                         [(8, 2, 4096, 1024, 1), (8, 2, 1024, 768, 8), (4, 2, 512, 8192, 1), (6, 6, 520, 136, 2),
                          (128, 8, 2048, 768, 1)])
def test_small_batch_matches_the_twin(num_experts, k, hidden, inter, num_tokens, dtype) -> None:
    from stoker.kernels.fused_moe import fused_moe, small_tile_config

    if (hidden, inter) == (512, 8192):
        assert small_tile_config(2, 2, 512 + 64, 8192 + 64, 512, 8192)["SPLIT_K"] == 8
    x, w13, w2, weights, ids = case(num_experts, k, hidden, inter, num_tokens, dtype)
    out = torch.full_like(x, float("nan"))
    out.copy_(fused_moe(x, w13, w2, weights, ids, small_batch=True))
    assert not out.isnan().any()
    assert rel_err(out, reference.fused_moe_grouped(x, w13, w2, weights, ids)) < TOL[dtype]


@compiled_only
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("block", [None, 128], ids=["per-channel", "blocks-128"])
def test_small_batch_8bit_experts_match_the_twin(qdtype: str, block: int | None) -> None:
    from stoker.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = case(8, 2, 1024, 768, 2, torch.bfloat16)
    quantized = []
    for w in (w13, w2):
        if block is None:
            qs = [formats.quantize_rows(we, qdtype) for we in w.float()]
            quantized.append((torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs]), w.shape[2]))
            continue
        e, n, kk = w.shape
        blocks = w.float().abs().reshape(e, n // block, block, kk // block, block).amax(dim=(2, 4))
        blocks = blocks / (formats.FP8_MAX if qdtype == "fp8" else formats.INT8_MAX)
        rows = blocks.repeat_interleave(block, dim=1)
        quantized.append((formats.quantize_with(w.float(), rows.repeat_interleave(block, dim=2), qdtype), rows.contiguous(), block))
    (q13, s13, g13), (q2, s2, g2) = quantized
    out = fused_moe(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2, small_batch=True)
    twin = reference.fused_moe_grouped(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2)
    assert not out.isnan().any() and rel_err(out, twin) < TOL[torch.bfloat16]


@compiled_only
def test_small_batch_captures_in_a_cuda_graph_and_follows_the_routing() -> None:
    """4 tokens x top-2 = 8 pairs through the small path (forced: by default it serves one
    token); its expert order is found on the device, so one graph serves any routing."""
    from stoker.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = case(8, 2, 1024, 2048, 4, torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids, small_batch=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, small_batch=True)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        w_new, ids_new = softmax_topk(torch.randn(4, 8, generator=gen).cuda(), 2, renormalize=True)
        ids_new[:, 0] = 6  # every token on one expert: adjacent programs share its weights
        ids_new[:, 1] = torch.where(ids_new[:, 1] == 6, 1, ids_new[:, 1])
        weights.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference.fused_moe_grouped(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]
