"""The W4A8 C kernel (linear_q4_a8.h, stoker_linear_q4_a8) against its twin
(reference.linear_packed_q4_a8) bit for bit: activations quantized to int8 per block of 32,
exact integer dot products, the float sums in one fixed order. Odd shapes, groups of 32/64/128,
float16 and float32 scales, with and without offsets, bias, SiLU fused; batch and thread
invariance; the activation quantizer itself; planted faults; bad groups refused.
tests/kernels/test_cpu_isa.py runs this file on the AVX2 and SSE2 builds too, and checks that
every build gives the same bits."""

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


def packed(n: int, k: int, group: int, symmetric: bool, half_scales: bool, seed: int = 0, gate_up: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q, s, o = int4.quantize(torch.randn(n, k, generator=gen) / k**0.5, group, symmetric)
    if half_scales:  # GGUF Q4_0's form: float16 scales, no offsets
        s = s.half().float()
        o = -8 * s if symmetric else o
    return (cpu_q4.pack_q4_weight(q, gate_up), *cpu_q4.pack_q4_scales(s, o, gate_up)), int4.dequantize(q, s, o, group)


# (n, k, group, symmetric, float16 scales): whole and partial panels, one and several blocks per group
CASES = [(17, 128, 32, True, True), (130, 192, 64, True, False), (333, 256, 128, False, True), (95, 96, 32, False, False)]


@pytest.mark.parametrize("n, k, group, symmetric, half_scales", CASES)
def test_equals_its_twin_bit_for_bit_for_every_batch_size(n, k, group, symmetric, half_scales) -> None:
    (p, ps, po), dense = packed(n, k, group, symmetric, half_scales)
    assert (po is None) == symmetric
    bias = cpu_linear.pack_linear_weight(torch.randn(n))
    xs = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    xs[3, :32] = 0  # an all-zero block: scale 0, values 0
    for m in (1, 2, 9):  # one row tile, two, several with a partial one
        out = cpu_q4.linear_q4_a8(xs[:m], p, ps, po, group, n, bias)
        assert torch.equal(out, reference.linear_packed_q4_a8(xs[:m], p, ps, po, group, n, bias))
    # W4A8 is W4A16 up to the activations' rounding (half a step of amax / 127 per value)
    exact = F.linear(xs, dense) + bias[:n]
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()


def test_activation_blocks_quantize_as_q8_0() -> None:
    x = torch.randn(3, 64) * torch.tensor([1e-3, 1.0, 50.0]).unsqueeze(1)
    x[2, 32:] = 0
    a, d = reference.quantize_q8_blocks(x)
    assert a.dtype == torch.int8 and d.shape == (3, 2)
    assert a.abs().amax(dim=1)[:2].eq(127).all() and torch.equal(a[2, 32:], torch.zeros(32, dtype=torch.int8))
    assert d[2, 1] == 0
    err = (a.float().view(3, 2, 32) * d.unsqueeze(2) - x.view(3, 2, 32)).abs()
    assert (err <= d.unsqueeze(2) * 0.5 * (1 + 1e-5)).all()  # round to nearest


def test_a_rows_result_does_not_depend_on_the_batch_or_threads() -> None:
    (p, ps, po), _ = packed(200, 256, 64, symmetric=False, half_scales=False)
    xs = torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    full = cpu_q4.linear_q4_a8(xs, p, ps, po, 64, 200)
    for m in (1, 3, 7):
        assert torch.equal(cpu_q4.linear_q4_a8(xs[:m], p, ps, po, 64, 200), full[:m])
    assert torch.equal(cpu_q4.linear_q4_a8(xs[5:6], p, ps, po, 64, 200), full[5:6])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_q4.linear_q4_a8(xs, p, ps, po, 64, 200), full)
    finally:
        torch.set_num_threads(before)


def test_silu_and_mul_fused() -> None:
    inter = cpu_linear.panel_width()  # whole panels
    (p, ps, po), _ = packed(2 * inter, 128, 32, symmetric=True, half_scales=True, gate_up=True)
    x = torch.randn(3, 128)
    pre = cpu_q4.linear_q4_a8(x, p, ps, po, 32, 2 * inter)  # panel order: [gate | up] halves per panel
    gate, up = pre.view(3, -1, 2, inter // 2).unbind(dim=2)
    out = cpu_q4.linear_q4_a8(x, p, ps, po, 32, 2 * inter, silu_and_mul=True)
    torch.testing.assert_close(out, (F.silu(gate) * up).reshape(3, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, reference.linear_packed_q4_a8(x, p, ps, po, 32, 2 * inter, silu_and_mul=True),
                               rtol=1e-6, atol=1e-6)


def test_planted_faults_are_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin is not the kernel's echo: a scale off by 2x in one group moves that column only;
    activations rounded toward zero instead of to nearest move the output."""
    gen = torch.Generator().manual_seed(5)
    q, s, o = int4.quantize(torch.randn(96, 128, generator=gen) / 12, 32, symmetric=False)
    x = torch.randn(2, 128, generator=gen)
    p = cpu_q4.pack_q4_weight(q)
    good = cpu_q4.linear_q4_a8(x, p, *cpu_q4.pack_q4_scales(s, o), 32, 96)
    bad_s = s.clone()
    bad_s[5, 2] *= 2
    moved = (cpu_q4.linear_q4_a8(x, p, *cpu_q4.pack_q4_scales(bad_s, o), 32, 96) - good).abs().amax(dim=0) > 1e-5
    assert moved[5] and moved.sum() == 1
    nearest = reference.quantize_q8_blocks

    def toward_zero(v: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        _, d = nearest(v, block)
        a = torch.trunc(v.reshape(v.shape[0], -1, block) / d.clamp_min(1e-30).unsqueeze(2))
        return a.reshape(v.shape).to(torch.int8), d

    monkeypatch.setattr(reference, "quantize_q8_blocks", toward_zero)
    assert not torch.equal(reference.linear_packed_q4_a8(x, p, *cpu_q4.pack_q4_scales(s, o), 32, 96), good)


def test_groups_that_split_an_activation_block_are_refused() -> None:
    (p, ps, po), _ = packed(64, 128, 16, symmetric=True, half_scales=False)
    with pytest.raises(ValueError, match="group_k 16 must divide K = 128 and be a multiple of 32"):
        cpu_q4.linear_q4_a8(torch.randn(1, 128), p, ps, po, 16, 64)


@pytest.mark.parametrize("entry", [cpu_q4.linear_q4_a8, cpu_q4.linear_q4], ids=["w4a8", "w4a16"])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_a_bound_layer_gives_the_entry_points_bits(entry, silu_and_mul: bool) -> None:
    """BoundQ4Linear (the weights checked once) equals its entry point bit for bit, for (M, K)
    rows and for what it hands to the entry point: 3-D x, rows closer than K, a column stride."""
    nr = cpu_linear.panel_width()
    n, k = (2 * nr, 128) if silu_and_mul else (130, 192)
    (p, ps, po), _ = packed(n, k, 64, symmetric=False, half_scales=False, gate_up=silu_and_mul)
    bias = cpu_linear.pack_linear_weight(torch.randn(n), gate_up=silu_and_mul)
    bound = cpu_q4.BoundQ4Linear(entry, p, ps, po, 64, n, bias, silu_and_mul)
    wide = torch.randn(6, 2 * k)
    for x in (torch.randn(0, k), torch.randn(1, k), torch.randn(5, k), wide[:, :k], torch.randn(2, 3, k),
              wide.view(12, k)[::2], torch.randn(k, 4).t()):
        want = entry(x, p, ps, po, 64, n, bias, silu_and_mul)
        got = bound(x)
        assert got.shape == want.shape and torch.equal(got, want)


def test_a_bound_layer_refuses_what_its_entry_point_refuses() -> None:
    (p, ps, po), _ = packed(64, 128, 32, symmetric=True, half_scales=False)
    with pytest.raises(ValueError, match="group_k 16 must divide K = 128 and be a multiple of 32"):
        cpu_q4.BoundQ4Linear(cpu_q4.linear_q4_a8, p, ps, po, 16, 64)
    with pytest.raises(ValueError, match="bias"):
        cpu_q4.BoundQ4Linear(cpu_q4.linear_q4_a8, p, ps, po, 32, 64, torch.zeros(64, dtype=torch.float64))
    bound = cpu_q4.BoundQ4Linear(cpu_q4.linear_q4_a8, p, ps, po, 32, 64)
    with pytest.raises(ValueError, match="x must be float32"):
        bound(torch.randn(1, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not fit"):
        bound(torch.randn(1, 96))
