"""Triton fused SiLU-and-multiply vs reference.silu_and_mul, interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import assert_close, poisoned_like  # noqa: E402

from stoker.kernels import reference  # noqa: E402
from stoker.kernels.activation import silu_and_mul  # noqa: E402


@pytest.mark.parametrize(
    "shape, dtype",
    [((5, 2 * 96), torch.float32), ((2, 3, 2 * 2500), torch.float32), ((4, 2 * 1100), torch.bfloat16)],
)
def test_silu_and_mul_matches_twin(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # 2500 and 1100 columns: more than one 1024-column program per row, the last one partial.
    gen = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(shape, generator=gen)).to(dtype)
    out_buf = poisoned_like(reference.silu_and_mul(x))
    out = silu_and_mul(x, out=out_buf)
    assert out is out_buf and out.dtype == dtype
    # bf16: the twin rounds silu(gate) then the product (two roundings), the kernel once, and
    # the interpreter truncates: allow a few bf16 ulps against the float32 twin.
    ref = reference.silu_and_mul(x.float())
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 4 * 2**-7, "silu_and_mul")


def test_silu_and_mul_strided_rows() -> None:
    x = torch.randn(4, 3 * 128)[:, : 2 * 128]  # rows of a wider buffer
    assert_close(silu_and_mul(x), reference.silu_and_mul(x), 1e-5, "strided")


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_and_mul(torch.randn(2, 7))
