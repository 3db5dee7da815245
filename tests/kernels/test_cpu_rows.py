"""The C row kernels for CPU (stoker/kernels/cpu/elementwise.c) vs their twins in reference.py:
RMSNorm (with and without the fused residual add), SiLU-and-mul, rotary embedding."""

from __future__ import annotations

import shutil

import pytest
import torch
from paged_cases import assert_close, spy_cpu_kernels

from stoker.kernels import ops, reference
from stoker.kernels.cpu import elementwise as cpu_elementwise
from stoker.kernels.cpu import store_kvcache as cpu_store

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here (the torch twins run instead)", allow_module_level=True)

# Row counts either side of the one-thread / all-threads switch (32768 elements).
ROWS = [1, 7, 64, 300]


def cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 200, 512])
def test_rms_norm(num_rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(num_rows + hidden)
    x = torch.randn(num_rows, hidden, generator=gen) * 3
    residual = torch.randn(num_rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    assert_close(cpu_elementwise.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), 1e-5, "rms_norm")
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = cpu_elementwise.fused_add_rms_norm(x, residual, weight, 1e-5)
    out_ref, residual_ref = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, residual_ref)  # one float add: exact
    assert_close(out, out_ref, 1e-5, "fused_add_rms_norm")
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be written"


def test_rms_norm_strided_rows_and_3d() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(10, 96, generator=gen)
    x = wide[:, 16:80]  # rows 96 floats apart
    weight = torch.randn(64, generator=gen)
    assert_close(cpu_elementwise.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), 1e-5, "strided")
    x3 = torch.randn(2, 5, 64, generator=gen)
    out = cpu_elementwise.rms_norm(x3, weight, 1e-6)
    assert out.shape == x3.shape
    assert_close(out, reference.rms_norm(x3, weight, 1e-6), 1e-5, "3d")


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("d", [8, 100, 1408])
def test_silu_and_mul(num_rows: int, d: int) -> None:
    gen = torch.Generator().manual_seed(num_rows * d)
    x = torch.randn(num_rows, 2 * d, generator=gen) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating exp either way
    assert_close(cpu_elementwise.silu_and_mul(x), reference.silu_and_mul(x), 1e-5, "silu_and_mul")


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        cpu_elementwise.silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, rot_dim",
    [(4, 4, 64, 64), (8, 1, 128, 128), (6, 2, 128, 64), (8, 4, 48, 48)],
)
def test_rotary(num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, rot_dim: int) -> None:
    gen = torch.Generator().manual_seed(num_rows + head_dim)
    # q and k as views into one fused qkv projection, as the attention layer slices them.
    qkv = torch.randn(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim].view(num_rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_rows, num_kv_heads, head_dim)
    cache = cos_sin_cache(4096, rot_dim)
    positions = torch.randint(0, 4096, (num_rows,), generator=gen)
    qkv_before = qkv.clone()
    q_out, k_out = cpu_elementwise.rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert_close(q_out, q_ref, 1e-5, "query")
    assert_close(k_out, k_ref, 1e-5, "key")
    assert torch.equal(qkv, qkv_before), "inputs must not be written"


def test_rotary_rejects_positions_outside_the_table() -> None:
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    with pytest.raises(ValueError, match="positions"):
        cpu_elementwise.rotary_embedding(torch.tensor([0, 1, 512]), q, k, cos_sin_cache(512, 64))


def test_ops_dispatch_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 CPU rows take the C kernels; bfloat16, or the env var, take the twins."""
    calls: list[str] = []
    spy_cpu_kernels(monkeypatch, ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"), calls)
    x, w = torch.randn(4, 64), torch.randn(64)
    q, k, cache = torch.randn(4, 2, 64), torch.randn(4, 1, 64), cos_sin_cache(16, 64)
    pos = torch.arange(4)
    ops.rms_norm(x, w, 1e-6)
    ops.fused_add_rms_norm(x, x, w, 1e-6)
    ops.silu_and_mul(x)
    ops.rotary_embedding(pos, q, k, cache)
    assert calls == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"]
    ops.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    ops.silu_and_mul(x.bfloat16())
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    assert torch.equal(ops.silu_and_mul(x), reference.silu_and_mul(x))
    assert len(calls) == 4


@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_store_kvcache(num_tokens: int) -> None:
    """Rows land in their slots (from strided views of a fused qkv), -1 slots are skipped,
    every other slot is untouched; as the twin does."""
    num_blocks, block_size, num_kv_heads, head_dim = 40, 16, 2, 32
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::4] = -1
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan")) for _ in range(4)]
    cpu_store.store_kvcache(key, value, caches[0], caches[1], slots)
    reference.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert int(caches[0].isnan().all(dim=(2, 3)).sum()) == num_blocks * block_size - int((slots >= 0).sum())


def test_store_kvcache_rejects_slots_past_the_cache() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="past the cache"):
        cpu_store.store_kvcache(torch.ones(2, 1, 8), torch.ones(2, 1, 8), k_cache, v_cache, torch.tensor([3, 8]))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_store.store_kvcache(torch.ones(2, 2, 8), torch.ones(2, 2, 8), k_cache, v_cache, torch.tensor([0, 1]))
