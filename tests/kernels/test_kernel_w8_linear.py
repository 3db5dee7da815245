"""The quantized linear method's backends, each against the weight-only twin
(reference.w8_linear: dequantize, then F.linear): the Triton weight-only GEMM (interpreted
here, compiled in tests/gpu), W8A8 through torch._scaled_mm (runs on CPU too), torch's
_weight_int8pack_mm, the C kernel, and the twin itself as the fallback."""

from __future__ import annotations

import shutil

import pytest
import torch

from stoker.kernels import reference
from stoker.layers.linear import Linear, MergedLinear
from stoker.quantization import formats
from stoker.quantization.config import WeightScheme
from stoker.layers.quantized_method import QuantizedLinearMethod, _scaled_mm_linear


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_rows, out_features, in_features, group_k", [(1, 100, 96, 96), (5, 64, 256, 128), (33, 130, 300, 128), (3, 70, 64, 32)])
def test_triton_w8_linear_matches_twin(dtype, num_rows, out_features, in_features, group_k) -> None:
    pytest.importorskip("triton")
    from stoker.kernels.w8_linear import w8_linear

    gen = torch.Generator().manual_seed(0)
    q, _ = formats.quantize_rows(torch.randn(out_features, in_features, generator=gen), dtype)
    s = torch.rand(out_features, -(-in_features // group_k), generator=gen) * 0.01 + 0.001
    x = torch.randn(num_rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    assert rel_err(w8_linear(x, q, s, group_k, bias), reference.w8_linear(x, q, s, group_k, bias)) < 1e-6
    xb = x.bfloat16()
    # bf16 operands: each dequantized weight rounded to bf16 in both, the sums in other orders
    assert rel_err(w8_linear(xb, q, s, group_k, bias), reference.w8_linear(xb, q, s, group_k, bias)) < 1e-2


def test_triton_w8_linear_rejects_bad_arguments() -> None:
    pytest.importorskip("triton")
    from stoker.kernels.w8_linear import w8_linear

    q = torch.zeros(8, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="scale must be"):
        w8_linear(torch.randn(2, 32), q, torch.ones(8, 2), 32)
    with pytest.raises(ValueError, match="int8 or float8"):
        w8_linear(torch.randn(2, 32), q.float(), torch.ones(8, 1), 32)
    with pytest.raises(ValueError, match="does not fit"):
        w8_linear(torch.randn(2, 31), q, torch.ones(8, 1), 32)


def test_scaled_mm_w8a8_matches_its_definition() -> None:
    """Per-token activation scales and per-row weight scales: out = (xq sx)(wq sw)^T."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=gen) / 11
    q, s = formats.quantize_rows(w, "fp8")
    x = (torch.randn(7, 128, generator=gen) * 3).bfloat16()
    out = _scaled_mm_linear(x, q, s.reshape(1, -1), None, None)
    sx = x.float().abs().amax(1, keepdim=True) / 448
    xq = (x.float() / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
    expected = (xq.float() * sx) @ (q.float() * s).t()
    assert out.dtype == torch.bfloat16 and rel_err(out, expected) < 1e-2
    # ... and it stays near the weight-only result (the activations' own FP8 rounding)
    assert rel_err(out, reference.w8_linear(x.float(), q, s, 128)) < 5e-2


def _layer(backend: str, dtype: str, merged: bool, strategy: str = "channel") -> tuple[Linear, torch.Tensor]:
    """A quantized [q; k] (or plain) projection loaded online from a float weight; returns it and the float weight."""
    scheme = WeightScheme(dtype, strategy)
    layer = MergedLinear(64, {"q": 64, "k": 32}, bias=True) if merged else Linear(64, 96, bias=True)
    layer.attach(QuantizedLinearMethod(scheme, online=True, backend=backend))
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen) / 8
    b = torch.randn(96, generator=gen)
    if merged:
        for shard, rows in (("q", slice(0, 64)), ("k", slice(64, 96))):
            layer.method.load(layer, "weight", shard, w[rows])
            layer.method.load(layer, "bias", shard, b[rows])
    else:
        layer.method.load(layer, "weight", None, w)
        layer.method.load(layer, "bias", None, b)
    reference_weight = formats.dequantize(layer.weight, layer.weight_scale, layer.method.group_k)
    layer.method.process_after_loading(layer)
    return layer, reference_weight, b


BACKENDS = ["dequant", "int8pack", "triton_w8"] + (["cpu_q8"] if shutil.which("cc") or shutil.which("gcc") else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("merged", [False, True])
def test_every_backend_computes_the_dequantized_linear(backend: str, merged: bool) -> None:
    for dtype in ("int8", "fp8"):
        if backend == "int8pack" and dtype == "fp8":
            continue
        if backend == "triton_w8":
            pytest.importorskip("triton")
        layer, w, b = _layer(backend, dtype, merged)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
        expected = torch.nn.functional.linear(x, w, b)
        assert rel_err(layer(x), expected) < 1e-5, (backend, dtype)


def test_online_quantization_keeps_each_shards_rows_scaled_alone() -> None:
    """Per-row scales: quantizing shard by shard equals quantizing the stacked weight."""
    layer, _, _ = _layer("dequant", "int8", merged=True)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen) / 8
    q, s = formats.quantize_rows(w, "int8")
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, s)
