"""The C linear kernel for CPU (stoker/kernels/cpu/linear.c) on packed weights, against
F.linear and against its twin (reference.linear_packed); the packing itself; bad input."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.kernels.cpu import linear as cpu_linear

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here (the torch twins run instead)", allow_module_level=True)


def weights(out_features: int, in_features: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    return w, b


def pack(bias: torch.Tensor | None, gate_up: bool = False) -> torch.Tensor | None:
    return None if bias is None else cpu_linear.pack_linear_weight(bias, gate_up=gate_up)


# M either side of the register tile's rows (6 with AVX-512, 3 otherwise) and of the row
# chunk (192); N a whole panel, several, a partial one, and fewer than one vector.
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 6, 7, 13, 64, 193, 400])
@pytest.mark.parametrize("in_features, out_features", [(64, 64), (48, 200), (33, 17), (512, 1024), (7, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(num_tokens: int, in_features: int, out_features: int, bias: bool) -> None:
    w, b = weights(out_features, in_features, bias)
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(1))
    packed, packed_bias = cpu_linear.pack_linear_weight(w), pack(b)
    out = cpu_linear.linear(x, packed, out_features, packed_bias)
    expected = F.linear(x, w, b)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference.linear_packed(x, packed, out_features, packed_bias), expected, rtol=1e-5, atol=1e-5)


def test_packing_layout() -> None:
    w, _ = weights(100, 24, bias=False)
    packed = cpu_linear.pack_linear_weight(w)
    nr = cpu_linear.panel_width()
    assert packed.shape == (-(-100 // nr), 24, nr)
    unpacked = packed.permute(0, 2, 1).reshape(-1, 24)
    assert torch.equal(unpacked[:100], w)
    assert not unpacked[100:].any(), "the last panel's padding must be zero"


def test_strided_and_batched_input() -> None:
    """x may be a column slice of a wider tensor (row stride > K) and have leading dims."""
    w, b = weights(96, 40, bias=True)
    packed = cpu_linear.pack_linear_weight(w)
    wide = torch.randn(11, 64)
    x = wide[:, 8:48]
    torch.testing.assert_close(cpu_linear.linear(x, packed, 96, pack(b)), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 40)
    out = cpu_linear.linear(x3, packed, 96, pack(b))
    assert out.shape == (2, 5, 96)
    torch.testing.assert_close(out, F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def test_rows_do_not_depend_on_the_batch_or_the_threads() -> None:
    """Each output is one in-order sum over K: a row's result is bit-identical whether it
    is computed alone or among others, and whatever the thread count."""
    w, b = weights(300, 128, bias=True)
    packed, b = cpu_linear.pack_linear_weight(w), pack(b)
    x = torch.randn(70, 128)
    batched = cpu_linear.linear(x, packed, 300, b)
    for i in (0, 5, 6, 69):
        assert torch.equal(cpu_linear.linear(x[i : i + 1], packed, 300, b)[0], batched[i])
    assert torch.equal(cpu_linear.linear(x[3:20], packed, 300, b), batched[3:20])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_linear.linear(x, packed, 300, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batched)


def test_kernel_and_twin_agree() -> None:
    w, b = weights(130, 64, bias=True)
    packed, b = cpu_linear.pack_linear_weight(w), pack(b)
    x = torch.randn(9, 64)
    fast = cpu_linear.linear(x, packed, 130, b)
    twin = reference.linear_packed(x, packed, 130, b)
    torch.testing.assert_close(fast, twin, rtol=1e-5, atol=1e-5)


def test_empty_batch() -> None:
    w, _ = weights(64, 32, bias=False)
    out = cpu_linear.linear(torch.empty(0, 32), cpu_linear.pack_linear_weight(w), 64)
    assert out.shape == (0, 64)


def test_bad_input_is_refused() -> None:
    w, b = weights(100, 32, bias=True)
    packed = cpu_linear.pack_linear_weight(w)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_linear.linear(torch.randn(3, 31), packed, 100, pack(b))  # wrong K
    with pytest.raises(ValueError, match="does not fit"):
        cpu_linear.linear(torch.randn(3, 32), packed, packed.shape[0] * packed.shape[2] + 1)  # more outputs than panels
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.linear(torch.randn(3, 32), packed, 100, b)  # not in panel order (padded)
    with pytest.raises(ValueError, match="whole panels"):
        cpu_linear.linear(torch.randn(3, 32), packed, 100, silu_and_mul=True)
    with pytest.raises(ValueError, match="multiple of"):
        cpu_linear.pack_linear_weight(torch.randn(2 * cpu_linear.panel_width() // 2 + 2, 8), gate_up=True)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.linear(torch.randn(3, 32, dtype=torch.float64), packed, 100)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.pack_linear_weight(w.to(torch.bfloat16))


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_silu_and_mul(num_tokens: int, bias: bool) -> None:
    """A [gate; up] projection packed with gate_up=True returns silu(gate) * up directly."""
    inter = 3 * cpu_linear.panel_width() // 2
    w, b = weights(2 * inter, 80, bias)
    x = torch.randn(num_tokens, 80)
    packed, packed_bias = cpu_linear.pack_linear_weight(w, gate_up=True), pack(b, gate_up=True)
    out = cpu_linear.linear(x, packed, 2 * inter, packed_bias, silu_and_mul=True)
    gate_up = F.linear(x, w, b)
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert out.shape == (num_tokens, inter)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    twin = reference.linear_packed(x, packed, 2 * inter, packed_bias, silu_and_mul=True)
    torch.testing.assert_close(twin, expected, rtol=1e-5, atol=1e-5)


def test_gate_up_pre_activation_in_panel_order() -> None:
    """The same gate_up-packed weight without silu_and_mul gives the pre-activation with its
    columns in panel order (gate_up_rows says which [gate; up] row each is), and
    silu_and_mul_panels of it equals the fused kernel: the path a LoRA update goes through."""
    inter = 3 * cpu_linear.panel_width() // 2
    w, b = weights(2 * inter, 80, True)
    x = torch.randn(9, 80)
    packed, packed_bias = cpu_linear.pack_linear_weight(w, gate_up=True), pack(b, gate_up=True)
    pre = cpu_linear.linear(x, packed, 2 * inter, packed_bias)
    rows = cpu_linear.gate_up_rows(2 * inter)
    assert sorted(rows.tolist()) == list(range(2 * inter)) and rows.tolist() != list(range(2 * inter))
    torch.testing.assert_close(pre, F.linear(x, w, b)[:, rows], rtol=1e-5, atol=1e-5)
    fused = cpu_linear.linear(x, packed, 2 * inter, packed_bias, silu_and_mul=True)
    torch.testing.assert_close(cpu_linear.silu_and_mul_panels(pre), fused, rtol=1e-6, atol=1e-6)
