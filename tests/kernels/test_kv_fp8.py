"""The FP8 (E4M3) KV cache in every kernel that touches it: the C kernels (kernels/cpu), the
Triton kernels (interpreted here, compiled in tests/gpu) and their torch twins.

Store: x is written as e4m3(clamp(x * (1 / scale), -448, 448)) with 1 / scale rounded to
float32 once; the three stores must write the same bytes, and those are torch's own cast.
Attention: the cache is read as value * scale; decode and prefill kernels against the twins
on the same FP8 cache, with scales other than 1 and the NaN-poisoned padding of
paged_cases (an FP8 NaN byte where no sequence owns a slot).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from stoker.kernels import reference
from stoker.kernels._common import kv_inverse_scales
from tests.kernels.paged_cases import assert_close, make_paged_batch, poisoned_like

FP8 = torch.float8_e4m3fn
has_cc = shutil.which("cc") is not None or shutil.which("gcc") is not None


def special_values() -> torch.Tensor:
    """Every e4m3 code's value, the midpoints between neighbours (ties: round half to even),
    subnormals, values past 448 (clamped), and random normals at several scales."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    codes = codes[~codes.isnan()].sort().values
    mids = (codes[1:] + codes[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(2000, generator=gen) * s for s in (1e-3, 0.05, 1.0, 40.0, 600.0)])
    return torch.cat([codes, mids, torch.tensor([1e-9, -1e-9, 447.9, 448.0, 449.0, 1e6, -1e6]), rand])


def _store_all(store, values: torch.Tensor, k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    heads, dim = 2, 16
    n = -(-values.numel() // (heads * dim))
    padded = torch.zeros(n * heads * dim)
    padded[: values.numel()] = values
    key = padded.view(n, heads, dim)
    value = -key.flip(0)
    k_cache = torch.zeros(n + 3, 1, heads, dim, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(n + 3, generator=torch.Generator().manual_seed(1))[:n]
    store(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), key, value, slots


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_twin_store_is_torchs_cast(k_scale: float, v_scale: float) -> None:
    k_bytes, v_bytes, key, value, slots = _store_all(reference.store_kvcache, special_values(), k_scale, v_scale)
    k_inv, v_inv = kv_inverse_scales(k_scale, v_scale)
    expected_k = (key * k_inv).clamp(-448, 448).to(FP8).view(torch.uint8)
    assert torch.equal(k_bytes.view(-1, *key.shape[1:])[slots], expected_k)
    expected_v = (value * v_inv).clamp(-448, 448).to(FP8).view(torch.uint8)
    assert torch.equal(v_bytes.view(-1, *value.shape[1:])[slots], expected_v)


@pytest.mark.skipif(not has_cc, reason="no C compiler")
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_c_store_writes_the_twins_bytes(k_scale: float, v_scale: float) -> None:
    from stoker.kernels.cpu import store_kvcache as cpu_store

    c = _store_all(cpu_store.store_kvcache, special_values(), k_scale, v_scale)
    twin = _store_all(reference.store_kvcache, special_values(), k_scale, v_scale)
    assert torch.equal(c[0], twin[0]) and torch.equal(c[1], twin[1])


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_triton_store_writes_the_twins_bytes(k_scale: float, v_scale: float) -> None:
    pytest.importorskip("triton")
    from stoker.kernels.store_kvcache import store_kvcache

    values = special_values()[::3]  # the interpreter is slow; every third value still covers each kind
    tri = _store_all(store_kvcache, values, k_scale, v_scale)
    twin = _store_all(reference.store_kvcache, values, k_scale, v_scale)
    assert torch.equal(tri[0], twin[0]) and torch.equal(tri[1], twin[1])


def fp8_batch(context_lens, num_kv_heads, head_dim, block_size, k_scale, v_scale, seed=0):
    """A paged batch whose caches are FP8 (NaN bytes where no sequence owns a slot) and whose
    references are those caches dequantized (NaN -> 0)."""
    b = make_paged_batch(context_lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu", torch.Generator().manual_seed(seed))
    k8 = (b.k_cache / k_scale).to(FP8)
    v8 = (b.v_cache / v_scale).to(FP8)
    b.k_cache, b.v_cache = k8, v8
    b.k_ref = torch.nan_to_num(k8.float() * k_scale, nan=0.0)
    b.v_ref = torch.nan_to_num(v8.float() * v_scale, nan=0.0)
    return b


def zero_nan_bytes(cache: torch.Tensor) -> torch.Tensor:
    return torch.where(cache.float().isnan(), 0.0, cache.float()).to(FP8)


DECODE_CASES = [  # context_lens, H, Hkv, D, block_size, window
    ([1, 17, 100, 300], 8, 2, 64, 16, None),  # fast path (16-lane), GQA
    ([33, 64, 5], 4, 4, 40, 8, None),  # generic path (D not a multiple of 16)
    ([250, 70], 8, 1, 128, 32, 50),  # MQA, sliding window
    ([16, 31, 47], 6, 2, 32, 16, None),
]


@pytest.mark.skipif(not has_cc, reason="no C compiler")
@pytest.mark.parametrize("ctx, heads, kv_heads, head_dim, block_size, window", DECODE_CASES)
def test_c_decode_attention_on_fp8_cache(ctx, heads, kv_heads, head_dim, block_size, window) -> None:
    from stoker.kernels.cpu import paged_decode_attention as cpu_decode

    k_scale, v_scale = 0.02, 0.3
    b = fp8_batch(ctx, kv_heads, head_dim, block_size, k_scale, v_scale)
    q = torch.randn(len(ctx), heads, head_dim, generator=torch.Generator().manual_seed(5))
    scale = 1 / math.sqrt(head_dim)
    lens = b.context_lens_tensor()
    out = cpu_decode.paged_decode_attention(q, b.k_cache, b.v_cache, b.block_tables, lens, scale, window, k_scale, v_scale)
    ref = reference.paged_decode_attention(q, b.k_ref, b.v_ref, b.block_tables, lens, scale, window)
    assert_close(out, ref, 1e-5, "C decode fp8")
    k8, v8 = zero_nan_bytes(b.k_cache), zero_nan_bytes(b.v_cache)  # the twin's gather reads padding
    twin = reference.paged_decode_attention(q, k8, v8, b.block_tables, lens, scale, window, k_scale, v_scale)
    assert_close(twin, ref, 1e-6, "twin decode fp8")


PREFILL_CASES = [  # (context_len, q_len) per sequence, H, Hkv, D, block_size, window
    ([(9, 1), (120, 120), (77, 30)], 8, 2, 64, 16, None),
    ([(200, 64), (40, 40)], 4, 1, 32, 8, 24),
    ([(50, 50)], 4, 2, 48, 16, None),
]


def _prefill_inputs(seqs, heads, kv_heads, head_dim, block_size, k_scale, v_scale):
    ctx = [c for c, _ in seqs]
    cu = [0]
    for _, q_len in seqs:
        cu.append(cu[-1] + q_len)
    b = fp8_batch(ctx, kv_heads, head_dim, block_size, k_scale, v_scale, seed=2)
    q = torch.randn(cu[-1], heads, head_dim, generator=torch.Generator().manual_seed(6))
    return b, q, cu, ctx


@pytest.mark.skipif(not has_cc, reason="no C compiler")
@pytest.mark.parametrize("seqs, heads, kv_heads, head_dim, block_size, window", PREFILL_CASES)
def test_c_prefill_attention_on_fp8_cache(seqs, heads, kv_heads, head_dim, block_size, window) -> None:
    from stoker.kernels.cpu import build as cpu_build
    from stoker.kernels.cpu import prefill_attention as cpu_prefill

    if head_dim % cpu_build.library().stoker_linear_vl():
        pytest.skip("the C prefill kernel takes head_dim in whole vectors (others take the twin)")
    k_scale, v_scale = 0.05, 0.7
    b, q, cu, ctx = _prefill_inputs(seqs, heads, kv_heads, head_dim, block_size, k_scale, v_scale)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_prefill.paged_attention(q, b.k_cache, b.v_cache, b.block_tables, cu, ctx, scale, window, k_scale, v_scale)
    ref = reference.paged_attention(q, b.k_ref, b.v_ref, b.block_tables, cu, ctx, scale, window)
    assert_close(out, ref, 1e-5, "C prefill fp8")
    k8, v8 = zero_nan_bytes(b.k_cache), zero_nan_bytes(b.v_cache)
    twin = reference.paged_attention(q, k8, v8, b.block_tables, cu, ctx, scale, window, k_scale, v_scale)
    assert_close(twin, ref, 1e-6, "twin prefill fp8")


def test_triton_decode_and_prefill_on_fp8_cache() -> None:
    pytest.importorskip("triton")
    from stoker.kernels.paged_decode_attention import paged_decode_attention
    from stoker.kernels.paged_prefill_attention import paged_attention

    k_scale, v_scale = 0.02, 0.3
    b = fp8_batch([1, 40, 130], 2, 32, 16, k_scale, v_scale)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(5))
    lens = b.context_lens_tensor()
    for splits in (1, 4):
        out = paged_decode_attention(q, b.k_cache, b.v_cache, b.block_tables, lens, 0.17, None, out=poisoned_like(q),
                                     num_splits=splits, k_scale=k_scale, v_scale=v_scale)
        ref = reference.paged_decode_attention(q, b.k_ref, b.v_ref, b.block_tables, lens, 0.17)
        assert_close(out, ref, 1e-5, f"triton decode fp8 splits {splits}")
    b, q, cu, ctx = _prefill_inputs([(40, 40), (70, 9)], 4, 2, 32, 16, k_scale, v_scale)
    out = paged_attention(q, b.k_cache, b.v_cache, b.block_tables, cu, ctx, 0.17, 12, out=poisoned_like(q),
                          k_scale=k_scale, v_scale=v_scale)
    ref = reference.paged_attention(q, b.k_ref, b.v_ref, b.block_tables, cu, ctx, 0.17, 12)
    assert_close(out, ref, 1e-5, "triton prefill fp8")


@pytest.mark.skipif(not has_cc, reason="no C compiler")
def test_ops_send_fp8_caches_to_the_c_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.kernels import ops
    from tests.kernels.paged_cases import spy_cpu_kernels

    calls: list[str] = []
    spy_cpu_kernels(monkeypatch, ("store_kvcache", "paged_decode_attention"), calls)
    b = fp8_batch([5], 1, 64, 16, 1.0, 1.0)
    q = torch.randn(1, 1, 64)
    ops.store_kvcache(q[:, :1], q[:, :1], b.k_cache, b.v_cache, torch.tensor([0]), 1.0, 1.0)
    ops.paged_decode_attention(q, b.k_cache, b.v_cache, b.block_tables, b.context_lens_tensor(), 1.0, None, 1.0, 1.0)
    assert calls == ["store_kvcache", "paged_decode_attention"]
