"""The C linear kernel on one-byte weights (linear.c, stoker_linear_q8): INT8 and FP8 E4M3
panels with per-row and per-group scales, against F.linear on the dequantized weight and
against its twin (reference.linear_packed_q8); exact widening of every FP8 code; batch and
thread invariance across its two paths (widening in registers, and a dequantized panel for
larger batches); SiLU-and-mul fused; bad input."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.kernels.cpu import linear as cpu_linear
from stoker.quantization import formats

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)


def quantized(out_features: int, in_features: int, dtype: str, group_k: int | None = None, seed: int = 0):
    """(qweight (N, K), scale (N, G), group_k) with scales per row (group_k None) or per group."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    if group_k is None:
        q, s = formats.quantize_rows(w, dtype)
        return q, s, in_features
    groups = -(-in_features // group_k)
    s = torch.rand(out_features, groups, generator=gen) * 0.02 + 0.005
    q = formats.quantize_with(w, formats.expand_groups(s, group_k, in_features), dtype)
    return q, s, group_k


def run(x, q, s, group_k, bias=None, silu=False):
    packed = cpu_linear.pack_linear_weight(q, gate_up=silu)
    scales = cpu_linear.pack_scales(s, q.dtype, gate_up=silu)
    pb = None if bias is None else cpu_linear.pack_linear_weight(bias, gate_up=silu)
    return cpu_linear.linear_q8(x, packed, scales, group_k, q.shape[0], pb, silu), reference.linear_packed_q8(
        x, packed, scales, group_k, q.shape[0], pb, silu)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 13, 64, 200])  # both paths: in registers (< 3 tiles), buffered
@pytest.mark.parametrize("in_features, out_features, group_k", [(64, 64, None), (96, 200, None), (33, 17, None),
                                                                (300, 130, 128), (256, 64, 32)])
def test_matches_dequantized_linear(dtype, num_tokens, in_features, out_features, group_k) -> None:
    q, s, gk = quantized(out_features, in_features, dtype, group_k)
    bias = torch.randn(out_features)
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(1))
    out, twin = run(x, q, s, gk, bias)
    expected = F.linear(x, formats.dequantize(q, s, gk), bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(twin, expected, rtol=1e-5, atol=1e-5)


def test_every_fp8_code_widens_exactly() -> None:
    """Weights holding all 254 finite E4M3 codes, x = identity rows: y = the dequantized weight."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]
    k = codes.numel()
    q = codes.reshape(1, k).repeat(64, 1)
    s = torch.rand(64, 1) + 0.5
    out, twin = run(torch.eye(k), q, s, k)
    expected = (q.float() * s).t()
    assert torch.equal(out, expected) and torch.equal(twin, expected)


def test_every_int8_value_widens_exactly() -> None:
    q = torch.arange(-128, 128, dtype=torch.int8).reshape(1, 256).repeat(64, 1)
    s = torch.rand(64, 1) + 0.5
    out, _ = run(torch.eye(256), q, s, 256)
    assert torch.equal(out, (q.float() * s).t())


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_rows_do_not_depend_on_the_batch_or_the_threads(dtype: str) -> None:
    """A row alone (widened in registers), among 300 rows (dequantized panels) and on one
    thread: the same bits, because both paths compute w = q * s and the same ordered sum."""
    q, s, gk = quantized(200, 160, dtype, group_k=32)
    x = torch.randn(300, 160, generator=torch.Generator().manual_seed(3))
    batched, _ = run(x, q, s, gk)
    single = torch.cat([run(x[i : i + 1], q, s, gk)[0] for i in range(0, 300, 37)])
    assert torch.equal(single, batched[::37])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread, _ = run(x, q, s, gk)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batched)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_fused_silu_and_mul(dtype: str, num_tokens: int) -> None:
    inter = cpu_linear.panel_width()  # gate and up of whole half-panels
    q, s, gk = quantized(2 * inter, 96, dtype)
    x = torch.randn(num_tokens, 96)
    out, twin = run(x, q, s, gk, silu=True)
    y = F.linear(x, formats.dequantize(q, s, gk))
    expected = F.silu(y[:, :inter]) * y[:, inter:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(twin, expected, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused() -> None:
    q, s, gk = quantized(100, 32, "int8")
    packed, scales = cpu_linear.pack_linear_weight(q), cpu_linear.pack_scales(s, q.dtype)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn panels"):
        cpu_linear.linear_q8(torch.randn(3, 32), packed.float(), scales, gk, 100)
    with pytest.raises(ValueError, match="scales"):
        cpu_linear.linear_q8(torch.randn(3, 32), packed, scales[:, :-1], gk, 100)
    with pytest.raises(ValueError, match="scales"):
        cpu_linear.linear_q8(torch.randn(3, 32), packed, scales, 8, 100)  # 4 groups expected, 1 given
    with pytest.raises(ValueError, match="does not fit"):
        cpu_linear.linear_q8(torch.randn(3, 31), packed, scales, gk, 100)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.linear_q8(torch.randn(3, 32, dtype=torch.float64), packed, scales, gk, 100)
