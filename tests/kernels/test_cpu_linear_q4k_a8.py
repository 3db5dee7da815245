"""GGUF's Q4_K in its own bytes against int8 activations (linear_q4k_a8.h, stoker_linear_q4k_a8):
the C kernel against its twin (reference.linear_packed_q4k_a8) bit for bit, and against the
Q4_K weight as gguf-py's dequantize reads the file's bytes within the activations' rounding. The
6-bit sub-scales and the float pairs per 256 are recovered exactly from the 4-bit method's
scales d sc and offsets -dmin m (llama.cpp's quantizer gives each super-block's largest 63);
weights that are not Q4_K's form are not factored. Whole and partial panels, bias, SiLU fused,
batch and thread invariance, bad shapes refused. tests/kernels/test_cpu_isa.py runs this file on
the AVX2 and SSE2 builds too and checks that every build gives the same bits."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.kernels.cpu import linear as cpu_linear
from stoker.kernels.cpu import linear_q4
from stoker.quantization import gguf_blocks
from stoker.testing.gguf_checkpoint import quantize_q4_k

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)


def q4_k_weight(n: int, k: int, seed: int = 0):
    """A Q4_K tensor as the GGUF loader gives the 4-bit method (codes, scales, offsets) and its
    dequantized float32 weight (gguf-py)."""
    gen = torch.Generator().manual_seed(seed)
    raw = quantize_q4_k((torch.randn(n, k, generator=gen) / k**0.5).numpy())
    q, scale, offset = gguf_blocks.q4_k(torch.from_numpy(raw))
    return q, scale, offset, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)).float()


def packed(n: int, k: int, seed: int = 0, gate_up: bool = False):
    q, scale, offset, dense = q4_k_weight(n, k, seed)
    factors = linear_q4.factor_q4_k(scale, offset)
    assert factors is not None
    return (linear_q4.pack_q4_weight(q, gate_up), *linear_q4.pack_q4k_scales(*factors, gate_up)), dense


@pytest.mark.parametrize("n, k", [(17, 256), (128, 512), (333, 768)])
def test_equals_its_twin_bit_for_bit_and_the_q4_k_weight_within_the_activations_rounding(n, k) -> None:
    (p, sub, sup), dense = packed(n, k)
    bias = cpu_linear.pack_linear_weight(torch.randn(n))
    xs = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    xs[3, :32] = 0  # an all-zero block: scale 0, values 0
    for m in (1, 2, 9):  # one row tile, two, several with a partial one
        out = linear_q4.linear_q4k_a8(xs[:m], p, sub, sup, 32, n, bias)
        assert torch.equal(out, reference.linear_packed_q4k_a8(xs[:m], p, sub, sup, 32, n, bias))
    exact = F.linear(xs, dense) + bias[:n]
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()


def test_the_sub_scales_and_super_scales_are_the_files_exactly() -> None:
    _, scale, offset, _ = q4_k_weight(40, 512)
    sub, sup = linear_q4.factor_q4_k(scale, offset)
    assert sub.dtype == torch.uint8 and int(sub.max()) <= 63 and sup.shape == (2, 40, 2)
    assert torch.equal(sup[0].repeat_interleave(8, dim=1) * sub[0].float(), scale)
    assert torch.equal(-(sup[1].repeat_interleave(8, dim=1) * sub[1].float()), offset)


def test_weights_that_are_not_q4_k_are_not_factored() -> None:
    _, scale, offset, _ = q4_k_weight(8, 256)
    bad = scale.clone()
    bad[1, 3] *= 1.0 + 2.0**-20  # no longer d times an integer
    assert linear_q4.factor_q4_k(bad, offset) is None
    mixed = offset.clone()
    mixed[0, 0] = -mixed[0, 0] + 1.0  # a positive and negative offsets in one super-block
    assert linear_q4.factor_q4_k(scale, mixed) is None
    assert linear_q4.factor_q4_k(scale[:, :4].contiguous(), offset[:, :4].contiguous()) is None  # not whole 256s


def test_silu_fused_gate_up_equals_the_unfused_projection() -> None:
    inter = cpu_linear.panel_width()
    q, scale, offset, _ = q4_k_weight(2 * inter, 256, seed=4)
    factors = linear_q4.factor_q4_k(scale, offset)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    fused = linear_q4.linear_q4k_a8(x, linear_q4.pack_q4_weight(q, True), *linear_q4.pack_q4k_scales(*factors, True), 32,
                                    2 * inter, silu_and_mul=True)
    plain = linear_q4.linear_q4k_a8(x, linear_q4.pack_q4_weight(q), *linear_q4.pack_q4k_scales(*factors), 32, 2 * inter)
    torch.testing.assert_close(fused, F.silu(plain[:, :inter]) * plain[:, inter:], rtol=1e-5, atol=1e-6)


def test_batch_and_thread_invariant() -> None:
    (p, sub, sup), _ = packed(200, 512, seed=5)
    xs = torch.randn(11, 512, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_q4.linear_q4k_a8(xs, p, sub, sup, 32, 200)
        torch.set_num_threads(2)
        two = linear_q4.linear_q4k_a8(xs, p, sub, sup, 32, 200)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    for m in range(11):
        assert torch.equal(linear_q4.linear_q4k_a8(xs[m : m + 1], p, sub, sup, 32, 200)[0], one[m])


def test_bad_shapes_are_refused() -> None:
    (p, sub, sup), _ = packed(64, 256)
    with pytest.raises(ValueError, match="sub-scales"):
        linear_q4.linear_q4k_a8(torch.randn(1, 256), p, sub[:, :4].contiguous(), sup, 32, 64)
    with pytest.raises(ValueError, match="super-scales"):
        linear_q4.linear_q4k_a8(torch.randn(1, 256), p, sub, sup.double(), 32, 64)
    with pytest.raises(ValueError, match="groups of 32"):
        linear_q4.linear_q4k_a8(torch.randn(1, 256), p, sub, sup, 64, 64)
    with pytest.raises(ValueError, match="does not fit"):
        linear_q4.linear_q4k_a8(torch.randn(1, 128), p, sub, sup, 32, 64)
