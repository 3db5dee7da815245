"""Triton RMSNorm and fused residual-add + RMSNorm vs their twins, interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import assert_close, poisoned_like  # noqa: E402

from stoker.kernels import reference  # noqa: E402
from stoker.kernels.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402


@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 300), (1, 4096)])
def test_rms_norm_matches_twin(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    out = rms_norm(x, w, 1e-6, out=poisoned_like(x))
    assert_close(out, reference.rms_norm(x, w, 1e-6), 1e-5, "rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_twin(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 320, generator=gen).to(dtype)
    residual = torch.randn(5, 320, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(320, generator=gen)).to(dtype)
    residual_before = residual.clone()
    out, new_residual = fused_add_rms_norm(
        x, residual, w, 1e-5, out=poisoned_like(x), residual_out=poisoned_like(x)
    )
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, residual_before), "the input residual must not change"
    # float32: same sums. bf16: the interpreter truncates float32 -> bf16 where torch rounds
    # to nearest, so up to one bf16 ulp (2^-7 relative) per rounding; tests/gpu is tighter.
    rel = 1e-5 if dtype == torch.float32 else 3 * 2**-7
    assert_close(new_residual, ref_residual, rel, "residual")
    assert_close(out, ref_out, rel, "normed")


def test_fused_add_rms_norm_in_place_and_strided_input() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 2 * 128, generator=gen)
    x = hidden[:, :128]  # a strided row view: rows are not adjacent
    residual = torch.randn(6, 128, generator=gen)
    w = torch.randn(128, generator=gen)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, w, 1e-6)
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6, residual_out=residual)
    assert new_residual is residual
    assert_close(residual, ref_residual, 1e-6, "in-place residual")
    assert_close(out, ref_out, 1e-5, "normed")


def test_rms_norm_float32_weight_promotes_like_twin() -> None:
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(64)
    out = rms_norm(x, w, 1e-6)
    ref = reference.rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    assert_close(out, ref, 2**-7, "promoted")


def test_rms_norm_rejects_bad_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 64), torch.randn(32), 1e-6)
