"""The W6A8 C kernel (linear_q6_a8.h, stoker_linear_q6_a8: GGUF's Q6_K against int8 activations)
against its twin (reference.linear_packed_q6_a8) bit for bit, and against the Q6_K weight as
gguf-py's dequantize reads the file's bytes (independent of Stoker's decoding and packing) within
the activations' rounding. The panels hold Q6_K's bits: codes, sub-scales and super-scales come back exactly.
Whole and partial panels, one and several super-blocks, bias, SiLU fused; batch and thread
invariance; scales that do not factor and codes past 6 bits are not packed; bad shapes refused.
tests/kernels/test_cpu_isa.py runs this file on the AVX2 and SSE2 builds too, and checks that
every build gives the same bits."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.kernels.cpu import linear as cpu_linear
from stoker.kernels.cpu import linear_q6
from stoker.quantization import gguf_blocks
from stoker.testing.gguf_checkpoint import quantize_q6_k

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)


def q6_k_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K tensor as the GGUF loader gives it: (codes q - 32 int8, scales d * sc per 16), and its
    dequantized float32 weight."""
    gen = torch.Generator().manual_seed(seed)
    raw = quantize_q6_k((torch.randn(n, k, generator=gen) / k**0.5).numpy())
    q, scale = gguf_blocks.q6_k(torch.from_numpy(raw))
    return q, scale, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)).float()


def packed(n: int, k: int, seed: int = 0, gate_up: bool = False):
    q, scale, dense = q6_k_weight(n, k, seed)
    factors = linear_q6.factor_q6_scales(scale)
    assert factors is not None
    sc, d = factors
    return linear_q6.pack_q6_weight(q, sc, gate_up), linear_q6.pack_q6_super_scales(d, gate_up), dense


# (n, k): a partial last panel, whole panels, several super-blocks
CASES = [(17, 256), (128, 512), (333, 768)]


@pytest.mark.parametrize("n, k", CASES)
def test_equals_its_twin_bit_for_bit_and_the_q6_k_weight_within_the_activations_rounding(n, k) -> None:
    p, d, dense = packed(n, k)
    bias = cpu_linear.pack_linear_weight(torch.randn(n))
    xs = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    xs[3, :32] = 0  # an all-zero block: scale 0, values 0
    for m in (1, 2, 9):  # one row tile, two, several with a partial one
        out = linear_q6.linear_q6_a8(xs[:m], p, d, n, bias)
        assert torch.equal(out, reference.linear_packed_q6_a8(xs[:m], p, d, n, bias))
    exact = F.linear(xs, dense) + bias[:n]
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()


def test_the_panels_hold_the_files_codes_and_scales_exactly() -> None:
    q, scale, dense = q6_k_weight(70, 512)
    sc, d = linear_q6.factor_q6_scales(scale)
    assert torch.equal(d.repeat_interleave(16, dim=1) * sc.float(), scale)  # every product exact
    assert torch.equal(q.float() * scale.repeat_interleave(16, dim=1), dense)
    codes, subs = linear_q6.unpack_q6_panels(linear_q6.pack_q6_weight(q, sc))
    nr = cpu_linear.panel_width()
    assert torch.equal(codes.permute(1, 0, 2).reshape(512, -1)[:, :70], q.T.long())
    assert torch.equal(subs.permute(1, 0, 2).reshape(32, -1)[:, :70], sc.T.long())
    assert codes.shape[0] * nr >= 70 and bool((subs.permute(1, 0, 2).reshape(32, -1)[:, 70:] == 0).all())


def test_llama_cpps_minus_128_sub_scale_factors() -> None:
    """llama.cpp's quantizer gives a super-block's largest sub-scale -128 and d = -max / 128
    (negative d); the factoring finds it as well as the tests' writer's positive 127."""
    gen = torch.Generator().manual_seed(3)
    sc = torch.randint(-127, 128, (5, 32), generator=gen, dtype=torch.int8)
    sc[:, 3], sc[:, 20] = -128, -128  # each super-block's largest
    d = -torch.rand(5, 2, generator=gen).half().float()
    scale = d.repeat_interleave(16, dim=1) * sc.float()
    got_sc, got_d = linear_q6.factor_q6_scales(scale)
    assert torch.equal(got_d.repeat_interleave(16, dim=1) * got_sc.float(), scale)
    assert torch.equal(got_sc, sc) and torch.equal(got_d, d)


def test_weights_that_are_not_q6_k_are_not_packed() -> None:
    q, scale, _ = q6_k_weight(8, 256)
    scale[2, 5] *= 1.0 + 2.0**-20  # no longer d times an integer
    assert linear_q6.factor_q6_scales(scale) is None
    sc, _ = linear_q6.factor_q6_scales(q6_k_weight(8, 256)[1])
    with pytest.raises(ValueError, match="outside"):
        linear_q6.pack_q6_weight(torch.full((8, 256), 40, dtype=torch.int8), sc)
    with pytest.raises(ValueError, match="multiple of 256"):
        linear_q6.pack_q6_weight(q[:, :128].contiguous(), sc[:, :8].contiguous())


def test_silu_fused_gate_up_equals_the_unfused_projection() -> None:
    nr = cpu_linear.panel_width()
    inter = nr  # whole panels of gate and up
    q, scale, _ = q6_k_weight(2 * inter, 256, seed=4)
    sc, d = linear_q6.factor_q6_scales(scale)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    fused = linear_q6.linear_q6_a8(x, linear_q6.pack_q6_weight(q, sc, True), linear_q6.pack_q6_super_scales(d, True),
                                   2 * inter, silu_and_mul=True)
    plain = linear_q6.linear_q6_a8(x, linear_q6.pack_q6_weight(q, sc), linear_q6.pack_q6_super_scales(d), 2 * inter)
    torch.testing.assert_close(fused, F.silu(plain[:, :inter]) * plain[:, inter:], rtol=1e-5, atol=1e-6)


def test_batch_and_thread_invariant() -> None:
    p, d, _ = packed(200, 512, seed=5)
    xs = torch.randn(11, 512, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_q6.linear_q6_a8(xs, p, d, 200)
        torch.set_num_threads(2)
        two = linear_q6.linear_q6_a8(xs, p, d, 200)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    for m in range(11):  # a row alone is the same row in the batch
        assert torch.equal(linear_q6.linear_q6_a8(xs[m : m + 1], p, d, 200)[0], one[m])


def test_bad_shapes_are_refused() -> None:
    p, d, _ = packed(64, 256)
    with pytest.raises(ValueError, match="super-scales"):
        linear_q6.linear_q6_a8(torch.randn(1, 256), p, d[:, :32].contiguous(), 64)
    with pytest.raises(ValueError, match="does not fit"):
        linear_q6.linear_q6_a8(torch.randn(1, 128), p, d, 64)
    with pytest.raises(ValueError, match="uint8 panels"):
        linear_q6.linear_q6_a8(torch.randn(1, 256), p.view(torch.int8), d, 64)
