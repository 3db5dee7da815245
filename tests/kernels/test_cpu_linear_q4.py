"""The C linear kernel on 4-bit affine weights (linear_q4.h, stoker_linear_q4) against its twin
(reference.linear_packed_q4) and F.linear on the dequantized weight, over odd shapes, M = 1..17
and groups of 32/64/128, with float16 and float32 scales, with and without offsets; the panel
layout round trip; the in-register path (small M) and the converted-codes path (larger M) bit
for bit; batch and thread invariance, SiLU fused, planted faults caught, bad input refused.
tests/kernels/test_cpu_isa.py runs this file on the AVX2 and SSE2 builds as well."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.kernels.cpu import linear as cpu_linear
from stoker.kernels.cpu import linear_q4 as cpu_q4
from stoker.quantization import int4

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)


def quantized(n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return int4.quantize(w, group, symmetric)


def packed(q, s, o, gate_up=False):
    return (cpu_q4.pack_q4_weight(q, gate_up), *cpu_q4.pack_q4_scales(s, o, gate_up))


SHAPES = [(17, 128, 32), (200, 384, 128), (130, 192, 64), (64, 64, 32), (333, 256, 128), (95, 96, 32)]


@pytest.mark.parametrize("half_scales", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n, k, group", SHAPES)
def test_matches_twin_and_dequantized_linear_for_every_batch_size(n, k, group, symmetric, half_scales) -> None:
    q, s, o = quantized(n, k, group, symmetric)
    # exact in float16 (GGUF Q4_0's d, most checkpoints', online int4's), or not (held as float32)
    s = s.half().float() if half_scales else s * (1 + 2**-20)
    o = -8 * s if symmetric else o
    p, ps, po = packed(q, s, o)
    assert ps.dtype == (torch.float16 if half_scales else torch.float32)
    assert (po is None) == symmetric  # symmetric: o + 8 s is 0, no offsets held
    bias = torch.randn(n)
    pb = cpu_linear.pack_linear_weight(bias)
    dense = int4.dequantize(q, s, o, group)
    xs = torch.randn(17, k, generator=torch.Generator().manual_seed(1))
    for m in range(1, 18):
        x = xs[:m]
        out = cpu_q4.linear_q4(x, p, ps, po, group, n, pb)
        twin = reference.linear_packed_q4(x, p, ps, po, group, n, pb)
        torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, F.linear(x, dense, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, k, group", SHAPES)
def test_panels_hold_the_codes_in_the_kernels_order(n, k, group) -> None:
    q, _, _ = quantized(n, k, group, symmetric=False)
    p = cpu_q4.pack_q4_weight(q)
    nr = cpu_linear.panel_width()
    assert p.shape == (-(-n // nr), k, nr // 2) and p.dtype == torch.uint8
    expected = cpu_linear.pack_linear_weight(q).to(torch.int64) - 8  # (P, K, NR), padded columns code 8 -> 0
    expected[-1, :, n % nr or nr:] = 0
    assert torch.equal(cpu_q4.unpack_q4_panels(p), expected)
    # lane n of block b, nibble i: row 8 b + i of column n (linear_q4.h), stored as q ^ 8
    lane = p[0].view(torch.int32).view(k // 8, nr)[1, 3].item() & 0xFFFFFFFF
    assert (lane >> 8) & 0xF == int(q[3, 10]) ^ 8


@pytest.mark.parametrize("n, k, group", SHAPES)
def test_register_and_converted_code_paths_give_the_same_bits(n, k, group) -> None:
    """M < 3 row tiles convert the codes in registers; more convert a panel once into a float
    buffer: the same values, summed in the same order, so a row's bits do not depend on which."""
    q, s, o = quantized(n, k, group, symmetric=False, seed=3)
    p, ps, po = packed(q, s, o)
    xs = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    full = cpu_q4.linear_q4(xs, p, ps, po, group, n)
    for m in (1, 2, 5, 17):
        assert torch.equal(cpu_q4.linear_q4(xs[:m], p, ps, po, group, n), full[:m])


def test_a_planted_fault_in_one_group_is_seen() -> None:
    """A scale off by 2x in one group, or an offset dropped, moves the affected columns only."""
    q, s, o = quantized(96, 128, 32, symmetric=False)
    x = torch.randn(3, 128)
    good = cpu_q4.linear_q4(x, *packed(q, s, o), 32, 96)
    bad_s = s.clone()
    bad_s[5, 2] *= 2
    moved = (cpu_q4.linear_q4(x, *packed(q, bad_s, o), 32, 96) - good).abs().amax(dim=0) > 1e-4
    assert moved[5] and moved.sum() == 1
    p, ps, po = packed(q, s, o)
    assert not torch.allclose(cpu_q4.linear_q4(x, p, ps, None, 32, 96), good, atol=1e-3)


def test_a_rows_result_does_not_depend_on_the_batch_or_threads() -> None:
    q, s, o = quantized(200, 256, 32, symmetric=False)
    p, ps, po = packed(q, s, o)
    xs = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    full = cpu_q4.linear_q4(xs, p, ps, po, 32, 200)
    for m in (1, 3, 7, 17):
        assert torch.equal(cpu_q4.linear_q4(xs[:m], p, ps, po, 32, 200), full[:m])
    assert torch.equal(cpu_q4.linear_q4(xs[5:6], p, ps, po, 32, 200), full[5:6])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_q4.linear_q4(xs, p, ps, po, 32, 200), full)
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
        out = cpu_q4.linear_q4(x[:m], p, ps, po, 64, 2 * inter, silu_and_mul=True)
        torch.testing.assert_close(out, expected[:m], rtol=1e-5, atol=1e-5)
        twin = reference.linear_packed_q4(x[:m], p, ps, po, 64, 2 * inter, silu_and_mul=True)
        torch.testing.assert_close(out, twin, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused() -> None:
    q, s, o = quantized(64, 128, 32, symmetric=False)
    p, ps, po = packed(q, s, o)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="group_k 48 must divide K = 128"):
        cpu_q4.linear_q4(x, p, ps, po, 48, 64)
    with pytest.raises(ValueError, match="group_k 4 must divide K = 128 and be a multiple of 8"):
        cpu_q4.linear_q4(x, p, ps, po, 4, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        cpu_q4.pack_q4_weight(torch.zeros(8, 12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        cpu_q4.linear_q4(x, p, ps.double(), po, 32, 64)
    with pytest.raises(ValueError, match="offsets"):
        cpu_q4.linear_q4(x, p, ps, po[:2], 32, 64)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_q4.linear_q4(torch.randn(2, 96), p, ps, po, 32, 64)
    with pytest.raises(ValueError, match="uint8 panels"):
        cpu_q4.linear_q4(x, p.to(torch.int8), ps, po, 32, 64)
    with pytest.raises(ValueError, match="uint8 codes"):
        cpu_q4.pack_q4_weight(q.to(torch.int8))
