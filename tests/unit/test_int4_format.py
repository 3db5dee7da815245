"""The affine int4 representation (quantization/int4.py): quantize/dequantize error bounds,
packing round trips, refusals naming the sizes, and the loader entry point's checks."""

from __future__ import annotations

import pytest
import torch

from stoker.quantization import int4


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_to_nearest_is_within_half_a_step(symmetric: bool, group_size: int) -> None:
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(0))
    q, scale, offset = int4.quantize(w, group_size, symmetric)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (24, 256 // group_size)
    if symmetric:
        torch.testing.assert_close(offset, -8 * scale)
    err = (int4.dequantize(q, scale, offset, group_size) - w).abs()
    assert bool((err <= int4.expand(scale, group_size) * 0.5 + 1e-6).all())


def test_asymmetric_uses_the_whole_range_and_hits_min_and_max() -> None:
    w = torch.rand(4, 64) * 3 + 1  # all positive: symmetric would waste half its codes
    q, scale, offset = int4.quantize(w, 32, symmetric=False)
    assert int(q.min()) == 0 and int(q.max()) == 15
    deq = int4.dequantize(q, scale, offset, 32)
    torch.testing.assert_close(deq.amin(1), w.amin(1))


def test_dequantize_is_product_rounded_then_sum_rounded() -> None:
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    s, o = torch.rand(8, 2) * 0.1, torch.randn(8, 2) * 0.3
    expected = (q.float() * s.repeat_interleave(32, 1)) + o.repeat_interleave(32, 1)
    assert torch.equal(int4.dequantize(q, s, o, 32), expected)


def test_pack_low_nibble_is_even_column_and_round_trips() -> None:
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = int4.pack(q)
    assert packed.tolist() == [[0x21, 0x0F]]
    r = torch.randint(0, 16, (5, 66), dtype=torch.uint8)
    assert torch.equal(int4.unpack(int4.pack(r)), r)


def test_k_not_a_multiple_of_the_group_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="100 input columns are not a multiple of the int4 group size 32"):
        int4.quantize(torch.randn(2, 100), 32)


def test_affine_check_names_the_bad_part() -> None:
    q = torch.zeros(4, 64, dtype=torch.uint8)
    int4.AffineInt4(q, torch.ones(4, 2), torch.zeros(4, 2), 32).check()
    with pytest.raises(ValueError, match=r"scale must be \(4, 2\)"):
        int4.AffineInt4(q, torch.ones(4, 1), torch.zeros(4, 2), 32).check()
    with pytest.raises(ValueError, match="codes must be in"):
        int4.AffineInt4(q + 16, torch.ones(4, 2), torch.zeros(4, 2), 32).check()
    with pytest.raises(ValueError, match="2-D uint8"):
        int4.AffineInt4(q.to(torch.int8), torch.ones(4, 2), torch.zeros(4, 2), 32).check()


def test_symmetric_and_zero_point_constructors_dequantize_as_their_formats() -> None:
    qs = torch.randint(-8, 8, (3, 32), dtype=torch.int8)
    s = torch.rand(3, 1) + 0.1
    a = int4.AffineInt4.from_symmetric(qs, s, 32)
    torch.testing.assert_close(a.dequantize(), qs.float() * s)
    qu = torch.randint(0, 16, (3, 32), dtype=torch.uint8)
    z = torch.randint(0, 16, (3, 1)).float()
    b = int4.AffineInt4.from_zero_point(qu, s, z, 32)
    torch.testing.assert_close(b.dequantize(), (qu.float() - z) * s)
