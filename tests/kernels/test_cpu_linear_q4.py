"""The C linear kernel on 4-bit affine weights (linear.c, stoker_linear_q4) against its twin
(reference.linear_packed_q4) and F.linear on the dequantized weight, over odd shapes, M = 1..17
and groups of 32/64/128; bit for bit against the float kernel on the same dequantized panels
(so every FMA build computes what the float path computes), batch and thread invariance, SiLU
fused, bad input refused. tests/kernels/test_cpu_isa.py runs this file on the AVX2 and SSE2
builds as well."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.kernels.cpu import linear as cpu_linear
from stoker.quantization import int4

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)


def quantized(n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return int4.quantize(w, group, symmetric)


def packed(q, s, o, gate_up=False):
    return (cpu_linear.pack_q4_weight(q, gate_up), cpu_linear.pack_scales(s, torch.float32, gate_up),
            cpu_linear.pack_scales(o, torch.float32, gate_up))


SHAPES = [(17, 128, 32), (200, 384, 128), (130, 192, 64), (64, 64, 32), (333, 256, 128), (95, 96, 32)]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n, k, group", SHAPES)
def test_matches_twin_and_dequantized_linear_for_every_batch_size(n, k, group, symmetric) -> None:
    q, s, o = quantized(n, k, group, symmetric)
    p, ps, po = packed(q, s, o)
    bias = torch.randn(n)
    pb = cpu_linear.pack_linear_weight(bias)
    dense = int4.dequantize(q, s, o, group)
    xs = torch.randn(17, k, generator=torch.Generator().manual_seed(1))
    for m in range(1, 18):
        x = xs[:m]
        out = cpu_linear.linear_q4(x, p, ps, po, group, n, pb)
        twin = reference.linear_packed_q4(x, p, ps, po, group, n, pb)
        torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, F.linear(x, dense, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, k, group", SHAPES)
def test_twin_dequantizes_exactly_as_the_representation_defines(n, k, group) -> None:
    q, s, o = quantized(n, k, group, symmetric=False)
    p, ps, po = packed(q, s, o)
    panels = reference.dequantize_panels_q4(p, ps, po, group)
    assert torch.equal(panels, cpu_linear.pack_linear_weight(int4.dequantize(q, s, o, group)))


@pytest.mark.parametrize("n, k, group", SHAPES)
def test_bit_equal_to_the_float_kernel_on_the_dequantized_panels(n, k, group) -> None:
    """w = q * s + o is made exactly (two roundings, never fused) in registers and in the
    buffered path; the rest is the float kernel's sum, so the outputs are the same bits."""
    q, s, o = quantized(n, k, group, symmetric=True, seed=3)
    p, ps, po = packed(q, s, o)
    float_panels = reference.dequantize_panels_q4(p, ps, po, group)
    xs = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    for m in (1, 2, 5, 17, 40):  # in registers (< 3 row tiles) and dequantized once per panel
        assert torch.equal(cpu_linear.linear_q4(xs[:m], p, ps, po, group, n), cpu_linear.linear(xs[:m], float_panels, n))


def test_a_rows_result_does_not_depend_on_the_batch_or_threads() -> None:
    q, s, o = quantized(200, 256, 32, symmetric=False)
    p, ps, po = packed(q, s, o)
    xs = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    full = cpu_linear.linear_q4(xs, p, ps, po, 32, 200)
    for m in (1, 3, 7, 17):
        assert torch.equal(cpu_linear.linear_q4(xs[:m], p, ps, po, 32, 200), full[:m])
    assert torch.equal(cpu_linear.linear_q4(xs[5:6], p, ps, po, 32, 200), full[5:6])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.linear_q4(xs, p, ps, po, 32, 200), full)
    finally:
        torch.set_num_threads(before)


def test_silu_and_mul_fused() -> None:
    inter = cpu_linear.panel_width()  # whole panels
    q, s, o = quantized(2 * inter, 128, 64, symmetric=True)
    p, ps, po = packed(q, s, o, gate_up=True)
    x = torch.randn(9, 128)
    pre = F.linear(x, int4.dequantize(q, s, o, 64))
    expected = F.silu(pre[:, :inter]) * pre[:, inter:]
    for m in (1, 9):
        out = cpu_linear.linear_q4(x[:m], p, ps, po, 64, 2 * inter, silu_and_mul=True)
        torch.testing.assert_close(out, expected[:m], rtol=1e-5, atol=1e-5)
        twin = reference.linear_packed_q4(x[:m], p, ps, po, 64, 2 * inter, silu_and_mul=True)
        torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused() -> None:
    q, s, o = quantized(64, 128, 32, symmetric=True)
    p, ps, po = packed(q, s, o)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="group_k 48 must divide K = 128"):
        cpu_linear.linear_q4(x, p, ps, po, 48, 64)
    with pytest.raises(ValueError, match="offsets"):
        cpu_linear.linear_q4(x, p, ps, po[:2], 32, 64)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_linear.linear_q4(torch.randn(2, 96), p, ps, po, 32, 64)
    with pytest.raises(ValueError, match="uint8 panels"):
        cpu_linear.linear_q4(x, p.to(torch.int8), ps, po, 32, 64)
    with pytest.raises(ValueError, match="uint8 codes"):
        cpu_linear.pack_q4_weight(q.to(torch.int8))
