"""Triton KV store vs reference.store_kvcache, under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from stoker.kernels import reference  # noqa: E402
from stoker.kernels.store_kvcache import store_kvcache  # noqa: E402

NAN = float("nan")


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, block_size, dtype",
    [(1, 64, 16, torch.float32), (8, 128, 32, torch.float32), (4, 64, 16, torch.bfloat16)],
)
def test_store_matches_twin(num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_blocks = 21, 6
    # key/value as the runner gets them: non-contiguous views into one fused qkv projection.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 7, 20]] = -1  # padding tokens: their K/V must not land anywhere
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(cache_shape, NAN, dtype=dtype), torch.full(cache_shape, NAN, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    reference.store_kvcache(key, value, k_ref, v_ref, slots)
    # A pure copy: bit-exact, and every slot not in slot_mapping is still NaN.
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert int((~torch.isnan(k_cache.float())).sum()) == (num_tokens - 3) * num_kv_heads * head_dim


def test_store_casts_to_cache_dtype_and_int32_slots() -> None:
    key = torch.randn(5, 2, 64)
    value = torch.randn(5, 2, 64)
    k_cache = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, -1, 0, 31], dtype=torch.int32)
    store_kvcache(key, value, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 2, 64).float()
    # The interpreter (triton 3.9) truncates float32 -> bf16 where the GPU rounds to nearest
    # even, so allow one bf16 ulp (2^-7 relative) here; tests/gpu checks exact equality.
    torch.testing.assert_close(flat[[3, 17, 0, 31]], key[[0, 1, 3, 4]], rtol=2**-7, atol=0)
    assert not flat[[i for i in range(32) if i not in (3, 17, 0, 31)]].any()


def test_store_rejects_bad_arguments() -> None:
    key = torch.randn(4, 2, 64)
    k_cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(key, key, k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not match"):
        store_kvcache(key, key, torch.zeros(2, 16, 4, 64), torch.zeros(2, 16, 4, 64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.randn(4, 2, 128)[..., ::2]
        store_kvcache(strided, strided, k_cache, k_cache.clone(), torch.zeros(4, dtype=torch.int64))
