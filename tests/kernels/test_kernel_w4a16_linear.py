"""The Triton W4A16 GEMM (kernels/w4a16_linear.py, interpreted here, compiled in tests/gpu)
against its twin (reference.w4a16_linear) and against F.linear on the weight
quantization/int4.dequantize defines: odd M, N not a multiple of the N tile, groups of
32/64/128 and per channel, symmetric (no offsets held) and asymmetric, split K (decode) and
the prefill tiling; the int4 method's triton_w4a16 backend on a merged layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.quantization import int4

triton = pytest.importorskip("triton")
from stoker.kernels.w4a16_linear import hold_scales, tile_config, w4a16_linear  # noqa: E402


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def quantized(n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, s, o = int4.quantize(torch.randn(n, k, generator=gen) / k**0.5, group, symmetric)
    return q, s, o


# (M, N, K, group): M odd / 1 / 33 (prefill tiling), N not a multiple of 32 or 64
CASES = [(1, 70, 256, 32), (3, 50, 512, 32), (5, 45, 256, 64), (3, 40, 256, 128), (33, 70, 128, 64), (2, 24, 96, 96)]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_rows, out_features, in_features, group", CASES)
def test_matches_twin_and_the_dequantized_linear(num_rows, out_features, in_features, group, symmetric) -> None:
    q, s, o = quantized(out_features, in_features, group, symmetric)
    packed = int4.pack(q)
    scale, offset = hold_scales(s, o)
    assert (offset is None) == symmetric and scale.dtype == (torch.float16 if symmetric else torch.float32)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    out = w4a16_linear(x, packed, scale, offset, group, bias)
    assert rel_err(out, reference.w4a16_linear(x, packed, scale, offset, group, bias)) < 1e-6
    assert rel_err(out, F.linear(x, int4.dequantize(q, s, o, group), bias)) < 1e-5
    for dtype in (torch.bfloat16, torch.float16) if symmetric else (torch.bfloat16,):
        xh = x.to(dtype)
        out = w4a16_linear(xh, packed, scale, offset, group, bias)
        assert out.dtype == dtype
        # the same weight rounded to x's dtype in both, float32 sums in other orders, one rounding
        # of the result (which may land on the other side of a tie now and then)
        assert rel_err(out, reference.w4a16_linear(xh, packed, scale, offset, group, bias)) < 1e-4, dtype


def test_decode_splits_k_and_prefill_does_not() -> None:
    """The CASES above cover both: (3, 50, 512, 32) and (1, 70, 256, 32) split K; M = 33 does not."""
    assert tile_config(3, 50, 512, 32, 132)["SPLIT_K"] == 4
    assert tile_config(1, 70, 256, 32, 132)["SPLIT_K"] == 2
    assert tile_config(33, 70, 128, 64, 132)["SPLIT_K"] == 1
    # Llama-3-8B's q projection at decode: 128 N tiles, K split in 4 (8 tiles of 128 each)
    assert tile_config(1, 4096, 4096, 128, 132) == {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4}


def test_a_planted_fault_is_caught() -> None:
    """One group's scale off by 2x moves the result well past the tolerance used above."""
    q, s, o = quantized(40, 256, 64, symmetric=False)
    packed = int4.pack(q)
    scale, offset = hold_scales(s, o)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    ref = reference.w4a16_linear(x, packed, scale, offset, 64)
    scale[7, 2] *= 2
    assert rel_err(w4a16_linear(x, packed, scale, offset, 64), ref) > 1e-3


def test_rejects_bad_arguments() -> None:
    packed = torch.zeros(8, 32, dtype=torch.uint8)  # N 8, K 64
    with pytest.raises(ValueError, match="scale must be"):
        w4a16_linear(torch.randn(2, 64), packed, torch.ones(8, 1), None, 32)
    with pytest.raises(ValueError, match="uint8"):
        w4a16_linear(torch.randn(2, 64), packed.to(torch.int8), torch.ones(8, 2), None, 32)
    with pytest.raises(ValueError, match="does not fit"):
        w4a16_linear(torch.randn(2, 63), packed, torch.ones(8, 2), None, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        w4a16_linear(torch.randn(2, 64), packed, torch.ones(8, 4), None, 16)
    with pytest.raises(ValueError, match="offset must be"):
        w4a16_linear(torch.randn(2, 64), packed, torch.ones(8, 2), torch.ones(8, 2, dtype=torch.float16), 32)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_method_triton_backend_computes_the_dequantized_linear(symmetric: bool) -> None:
    """A merged [q; k] projection through Int4LinearMethod's triton_w4a16 backend: its affine
    weights loaded shard by shard (load_affine), held as the kernel reads them."""
    from stoker.layers.int4_method import Int4LinearMethod
    from stoker.layers.linear import MergedLinear
    from stoker.quantization.config import WeightScheme

    scheme = WeightScheme("int4", "group", group_size=32, symmetric=symmetric)
    layer = MergedLinear(64, {"q": 64, "k": 32}, bias=True)
    layer.attach(Int4LinearMethod(scheme, online=False, backend="triton_w4a16"))
    q, s, o = quantized(96, 64, 32, symmetric, seed=3)
    b = torch.randn(96, generator=torch.Generator().manual_seed(4))
    for shard, rows in (("q", slice(0, 64)), ("k", slice(64, 96))):
        layer.method.load_affine(layer, shard, int4.AffineInt4(q[rows], s[rows], o[rows], 32))
        layer.method.load(layer, "bias", shard, b[rows])
    layer.method.process_after_loading(layer)
    assert (layer.weight_offset is None) == symmetric and layer.weight.shape == (96, 32)
    # online int4 / GGUF / GPTQ scales are exact in float16 (int4.quantize rounds symmetric ones so)
    assert layer.weight_scale.dtype == (torch.float16 if symmetric else torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    expected = reference.int4_linear(x, q, s, o, 32, b)
    assert rel_err(layer(x), expected) < 1e-5


def test_backend_is_chosen_once_by_device_and_group(monkeypatch) -> None:
    from stoker.models.method_chooser import int4_backend
    from stoker.quantization.config import WeightScheme

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("STOKER_DISABLE_TRITON", raising=False)
    for group in (32, 64, 128):
        assert int4_backend(WeightScheme("int4", "group", group_size=group), cuda, False) == "triton_w4a16"
    assert int4_backend(WeightScheme("int4", "channel"), cuda, False) == "triton_w4a16"
    assert int4_backend(WeightScheme("int4", "group", group_size=16), cuda, False) == "dequant"  # K tiles of >= 32
    assert int4_backend(WeightScheme("int4", "group", group_size=32), cpu, True) == "cpu_q4"
    assert int4_backend(WeightScheme("int4", "group", group_size=32), cpu, False) == "dequant"
    monkeypatch.setenv("STOKER_DISABLE_TRITON", "1")
    assert int4_backend(WeightScheme("int4", "group", group_size=32), cuda, False) == "dequant"
