"""The one-call MoE kernel for CPU (stoker/kernels/cpu/moe.c) against its twin
(reference.fused_moe), against the per-expert path it replaced (the linear kernel called per
expert from layers/moe.py, bit for bit), and for batch, slot-order and thread invariance."""

from __future__ import annotations

import shutil

import pytest
import torch

from stoker.kernels import ops, reference
from stoker.kernels.cpu import linear as cpu_linear
from stoker.kernels.cpu import moe as cpu_moe
from stoker.layers.moe import FusedMoE, PackedCpuMoEMethod
from stoker.layers.moe_router import softmax_topk

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here (the torch twins run instead)", allow_module_level=True)


def experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13, w2


def routing(num_tokens: int, num_experts: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    return softmax_topk(logits, k, renormalize=True)


def run(x, w13, w2, weights, ids) -> torch.Tensor:
    inter = w2.shape[2]
    fused = cpu_linear.gate_up_fusable(inter)
    p13, p2 = cpu_moe.pack_experts(w13, w2, fused)
    return cpu_moe.fused_moe(x, p13, p2, weights, ids, inter, fused)


# (E, k, H, I, T): E = 1, k = E, odd H and I (partial panels, scalar tail columns, unfused
# SiLU), I filling whole panels (SiLU fused in the GEMM) for AVX-512 (NR 64) and AVX2 (NR 32),
# one token, 512 tokens (row chunks), and many experts most of them idle.
SHAPES = [(1, 1, 48, 32, 5), (4, 4, 40, 24, 9), (8, 2, 33, 17, 7), (6, 3, 64, 32, 1), (8, 2, 96, 64, 512),
          (32, 4, 72, 96, 3), (8, 2, 130, 48, 64)]
IDS = ["E=1", "k=E", "odd-H-and-I", "one-token", "512-tokens", "most-experts-idle", "partial-H-panel"]


@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens", SHAPES, ids=IDS)
def test_matches_the_twin(num_experts: int, k: int, hidden: int, inter: int, num_tokens: int) -> None:
    w13, w2 = experts(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(num_tokens, num_experts, k)
    out = run(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def per_expert_layer(w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
    """layers/moe.py's per-expert loop on the C linear kernel (what ran before moe.c), with the
    C SiLU-and-mul a built model binds for the unfused case."""
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    layer = FusedMoE(num_experts, hidden, inter)
    method = PackedCpuMoEMethod(cpu_linear.gate_up_fusable(inter))
    method.fused_moe = None
    layer.attach(method)
    layer.act.kernels = ops.CPU
    with torch.no_grad():
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
    method.process_after_loading(layer)
    return layer


@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens", SHAPES, ids=IDS)
def test_same_bits_as_the_per_expert_path(num_experts: int, k: int, hidden: int, inter: int, num_tokens: int) -> None:
    w13, w2 = experts(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(num_tokens, num_experts, k)
    loop = per_expert_layer(w13, w2)(x, weights, ids)
    assert torch.equal(run(x, w13, w2, weights, ids), loop)


@pytest.mark.parametrize("inter", [64, 17], ids=["fused-silu", "unfused-odd-I"])
def test_a_row_alone_equals_its_row_in_a_batch_of_64(inter: int) -> None:
    w13, w2 = experts(16, 80, inter)
    fused = cpu_linear.gate_up_fusable(inter)
    p13, p2 = cpu_moe.pack_experts(w13, w2, fused)
    x = torch.randn(64, 80, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(64, 16, 4, seed=3)
    whole = cpu_moe.fused_moe(x, p13, p2, weights, ids, inter, fused)
    for t in (0, 5, 31, 63):
        alone = cpu_moe.fused_moe(x[t : t + 1], p13, p2, weights[t : t + 1], ids[t : t + 1], inter, fused)
        assert torch.equal(alone[0], whole[t]), f"token {t}"
    # a strided x (a view of a wider tensor) reads the same rows
    wide = torch.cat([x, torch.zeros(64, 3)], dim=1)[:, :80]
    assert torch.equal(cpu_moe.fused_moe(wide, p13, p2, weights, ids, inter, fused), whole)


def test_slot_order_and_thread_count_do_not_change_the_bits() -> None:
    w13, w2 = experts(8, 64, 32)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(37, 8, 3, seed=5)
    base = run(x, w13, w2, weights, ids)
    assert torch.equal(run(x, w13, w2, weights.flip(1), ids.flip(1)), base)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(run(x, w13, w2, weights, ids), base), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_empty_batch_and_bad_input() -> None:
    w13, w2 = experts(4, 32, 16)
    p13, p2 = cpu_moe.pack_experts(w13, w2, False)
    weights, ids = routing(3, 4, 2)
    assert cpu_moe.fused_moe(torch.randn(0, 32), p13, p2, weights[:0], ids[:0], 16, False).shape == (0, 32)
    with pytest.raises(ValueError, match="outside"):
        cpu_moe.fused_moe(torch.randn(3, 32), p13, p2, weights, ids + 3, 16, False)
    with pytest.raises(ValueError, match="expected"):
        cpu_moe.fused_moe(torch.randn(3, 31), p13, p2, weights, ids, 16, False)
    with pytest.raises(ValueError, match="panels"):
        cpu_moe.fused_moe(torch.randn(3, 32), p13, p2, weights, ids, 24, False)
    with pytest.raises(ValueError, match="disagree"):
        cpu_moe.fused_moe(torch.randn(4, 32), p13, p2, weights, ids, 16, False)


@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens", SHAPES[:5], ids=IDS[:5])
def test_biases_and_the_clamped_swiglu_match_the_twin(num_experts: int, k: int, hidden: int, inter: int,
                                                      num_tokens: int) -> None:
    """gpt-oss's experts: per-expert biases on [gate; up] and down, its clamped SwiGLU (a limit
    low enough that both clamps bite), in the one C call against the expert loop twin."""
    from stoker.layers.activation import ClampedSwiGLU

    w13, w2 = experts(num_experts, hidden, inter)
    gen = torch.Generator().manual_seed(2)
    b13, b2 = torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(num_tokens, num_experts, k)
    act = ClampedSwiGLU(1.702, 0.5)
    p13, p2 = cpu_moe.pack_experts(w13, w2, False)
    out = cpu_moe.fused_moe(x, p13, p2, weights, ids, inter, False, cpu_moe.pack_expert_bias(b13),
                            cpu_moe.pack_expert_bias(b2), "swigluoai", act.alpha, act.limit)
    want = reference.fused_moe(x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # the biases count: without them the result is another one
    without = reference.fused_moe(x, w13, w2, weights, ids, act)
    assert (out - without).abs().max() > 1e-2


def test_the_kernel_refuses_a_bias_on_fused_silu_panels() -> None:
    w13, w2 = experts(2, 64, 32)
    p13, p2 = cpu_moe.pack_experts(w13, w2, False)
    x, (weights, ids) = torch.randn(3, 64), routing(3, 2, 1)
    with pytest.raises(ValueError, match="silu_fused takes SiLU without a gate/up bias"):
        cpu_moe.fused_moe(x, p13, p2, weights, ids, 32, True, cpu_moe.pack_expert_bias(torch.zeros(2, 64)))


@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens",
                         [(1, 1, 32, 32, 5), (4, 4, 64, 32, 9), (8, 2, 96, 64, 1), (8, 2, 64, 96, 300),
                          (32, 4, 160, 32, 3)],
                         ids=["E=1", "k=E", "one-token", "300-tokens-partial-panels", "most-experts-idle"])
def test_mxfp4_experts_match_the_twin_on_the_dequantized_weights(num_experts: int, k: int, hidden: int, inter: int,
                                                                 num_tokens: int) -> None:
    """moe.c's MXFP4 path (each task's panel dequantized from the 4-bit blocks) against
    reference.fused_moe on formats.dequantize_mxfp4's weights, with gpt-oss's biases and clamp."""
    from stoker.layers.activation import ClampedSwiGLU
    from stoker.quantization.formats import dequantize_mxfp4, quantize_mxfp4

    w13, w2 = experts(num_experts, hidden, inter)
    (b13_blocks, b13_scales), (b2_blocks, b2_scales) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    gen = torch.Generator().manual_seed(3)
    b13, b2 = torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(num_tokens, num_experts, k)
    act = ClampedSwiGLU(1.702, 1.5)
    out = cpu_moe.fused_moe_mxfp4(x, b13_blocks, b13_scales, b2_blocks, b2_scales, weights, ids,
                                  cpu_moe.pack_expert_bias(b13), cpu_moe.pack_expert_bias(b2), "swigluoai", 1.702, 1.5)
    dq13, dq2 = dequantize_mxfp4(b13_blocks, b13_scales), dequantize_mxfp4(b2_blocks, b2_scales)
    torch.testing.assert_close(out, reference.fused_moe(x, dq13, dq2, weights, ids, act, b13, b2), rtol=1e-5, atol=1e-5)
    # the same bits as the float kernel on the dequantized weights (the same tasks, the same sums)
    p13, p2 = cpu_moe.pack_experts(dq13, dq2, False)
    float_out = cpu_moe.fused_moe(x, p13, p2, weights, ids, inter, False, cpu_moe.pack_expert_bias(b13),
                                  cpu_moe.pack_expert_bias(b2), "swigluoai", 1.702, 1.5)
    assert torch.equal(out, float_out)
    # SiLU without biases too (the kernel's other activation)
    plain = cpu_moe.fused_moe_mxfp4(x, b13_blocks, b13_scales, b2_blocks, b2_scales, weights, ids)
    torch.testing.assert_close(plain, reference.fused_moe(x, dq13, dq2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens, group",
                         [(4, 2, 64, 32, 9, 32), (8, 2, 128, 40, 1, 8), (6, 3, 64, 128, 70, 64)],
                         ids=["groups-of-32", "one-token-partial-panels-groups-of-8", "70-tokens-groups-of-64"])
def test_int4_experts_match_the_twin_on_the_dequantized_weights(num_experts: int, k: int, hidden: int, inter: int,
                                                                num_tokens: int, group: int) -> None:
    """moe.c's int4 path (each task's panel dequantized from pack_coded_experts' codes, scales
    and offsets) against reference.fused_moe on int4.dequantize's weights (asymmetric groups),
    and the same bits as the float kernel on those weights; with biases and the clamped SwiGLU."""
    from stoker.layers.activation import ClampedSwiGLU
    from stoker.quantization import int4

    w13, w2 = experts(num_experts, hidden, inter)
    parts13 = [int4.quantize(w, group, symmetric=False) for w in w13]  # (q, scale, offset) per expert
    parts2 = [int4.quantize(w, group, symmetric=False) for w in w2]
    packed = [cpu_moe.pack_coded_experts(torch.stack([int4.pack(q) for q, _, _ in parts]),
                                        torch.stack([s for _, s, _ in parts]), torch.stack([o for *_, o in parts]))
              for parts in (parts13, parts2)]
    dq13 = torch.stack([int4.dequantize(q, s, o, group) for q, s, o in parts13])
    dq2 = torch.stack([int4.dequantize(q, s, o, group) for q, s, o in parts2])
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(num_tokens, num_experts, k)
    out = cpu_moe.fused_moe_int4(x, (*packed[0], group), (*packed[1], group), weights, ids)
    torch.testing.assert_close(out, reference.fused_moe(x, dq13, dq2, weights, ids), rtol=1e-5, atol=1e-5)
    p13, p2 = cpu_moe.pack_experts(dq13, dq2, False)
    assert torch.equal(out, cpu_moe.fused_moe(x, p13, p2, weights, ids, inter, False))
    gen = torch.Generator().manual_seed(3)
    b13, b2 = torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden, generator=gen)
    biased = cpu_moe.fused_moe_int4(x, (*packed[0], group), (*packed[1], group), weights, ids,
                                    cpu_moe.pack_expert_bias(b13), cpu_moe.pack_expert_bias(b2), "swigluoai", 1.702, 1.5)
    torch.testing.assert_close(biased, reference.fused_moe(x, dq13, dq2, weights, ids, ClampedSwiGLU(1.702, 1.5), b13, b2),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even groups that divide their K"):
        cpu_moe.fused_moe_int4(x, (*packed[0], 3), (*packed[1], group), weights, ids)


@pytest.mark.parametrize("bits13, bits2, group13, group2", [(4, 8, 32, 16), (8, 8, 32, 16), (8, 4, 16, 32)],
                         ids=["int4-gate-up-int8-down", "int8-both", "int8-gate-up-int4-down"])
def test_coded_experts_with_int8_codes_match_the_float_kernel_on_the_dequantized_weights(bits13: int, bits2: int,
                                                                                         group13: int, group2: int) -> None:
    """moe.c's coded path with int8 codes in a projection (a GGUF Q4_K_M layer: int4 gate/up beside
    a Q6_K down, groups of 16; Q5_K_M: int8 with offsets throughout): the same bits as the float
    kernel on int4.dequantize's weights, and the twin within float32 tolerance; partial panels."""
    from stoker.quantization import int4

    num_experts, k, hidden, inter, num_tokens = 5, 2, 96, 64, 11
    w13, w2 = experts(num_experts, hidden, inter, seed=4)
    gen = torch.Generator().manual_seed(5)

    def code(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stored codes, scale, offset, dequantized) of (E, N, K) float weights."""
        if bits == 4:
            parts = [int4.quantize(e, group, symmetric=False) for e in w]
            q = torch.stack([p[0] for p in parts])
            s, o = torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts])
            stored = int4.pack(q)
        else:  # signed codes with an affine offset per group, as Q5_K's (offset) or Q6_K's (offset 0)
            q = torch.randint(-32, 32, w.shape, generator=gen, dtype=torch.int8)
            s = torch.rand(*w.shape[:2], w.shape[2] // group, generator=gen) / 64
            o = torch.randn(*s.shape, generator=gen) / 8
            stored = q
        deq = torch.stack([int4.dequantize(q[e], s[e], o[e], group) for e in range(w.shape[0])])
        return stored, s, o, deq

    c13, s13, o13, dq13 = code(w13, bits13, group13)
    c2, s2, o2, dq2 = code(w2, bits2, group2)
    p13, p2 = cpu_moe.pack_coded_experts(c13, s13, o13), cpu_moe.pack_coded_experts(c2, s2, o2)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(6))
    weights, ids = routing(num_tokens, num_experts, k)
    out = cpu_moe.fused_moe_coded(x, (*p13, group13, bits13), (*p2, group2, bits2), weights, ids)
    f13, f2 = cpu_moe.pack_experts(dq13, dq2, False)
    assert torch.equal(out, cpu_moe.fused_moe(x, f13, f2, weights, ids, inter, False))
    torch.testing.assert_close(out, reference.fused_moe(x, dq13, dq2, weights, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="4- or 8-bit codes, not 6"):
        cpu_moe.fused_moe_coded(x, (*p13, group13, 6), (*p2, group2, bits2), weights, ids)


def test_packed_experts_are_the_stacked_panels_in_huge_pages_where_linux_has_them() -> None:
    """pack_experts writes each expert's panels into one (possibly huge-page) buffer: the same
    values as stacking pack_linear_weight; empty_huge is a plain contiguous tensor to its users."""
    from stoker.kernels.cpu import huge_pages

    w13, w2 = experts(3, 40, 32)
    p13, p2 = cpu_moe.pack_experts(w13, w2, silu_fused=cpu_linear.gate_up_fusable(32))
    assert torch.equal(p13, torch.stack([cpu_linear.pack_linear_weight(w, gate_up=cpu_linear.gate_up_fusable(32))
                                         for w in w13]))
    assert torch.equal(p2, torch.stack([cpu_linear.pack_linear_weight(w) for w in w2]))
    big = huge_pages.empty_huge((2, huge_pages.MIN_BYTES // 8), torch.float32)
    assert big.shape == (2, huge_pages.MIN_BYTES // 8) and big.dtype == torch.float32 and big.is_contiguous()
    big.fill_(2.0)
    assert float(big.sum()) == 2.0 * big.numel()
    if huge_pages._madvise() is not None:
        assert big.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert huge_pages.empty_huge((5,), torch.int64).shape == (5,)  # small: a plain tensor
