"""Triton rotary embedding vs reference.rotary_embedding, interpreter on CPU."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import assert_close, poisoned_like  # noqa: E402

from stoker.kernels import reference  # noqa: E402
from stoker.kernels.rotary import rotary_embedding  # noqa: E402


def cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0, linear_factor: float = 1.0) -> torch.Tensor:
    """(max_position, rot_dim) [cos | sin] in float32; the kernel does not care how it was scaled."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)) / linear_factor
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, rot_dim, dtype",
    [
        (4, 4, 64, 64, torch.float32),  # full rotary, no GQA
        (8, 1, 128, 128, torch.float32),  # GQA 8
        (6, 2, 128, 64, torch.float32),  # partial rotary: dims 64..127 pass through
        (8, 2, 64, 64, torch.bfloat16),
    ],
)
def test_rotary_matches_twin(num_heads: int, num_kv_heads: int, head_dim: int, rot_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens = 13
    # q and k as views into one fused qkv projection, as the attention layer slices them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    cache = cos_sin_cache(4096, rot_dim, linear_factor=2.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    q_out, k_out = rotary_embedding(positions, q, k, cache, query_out=poisoned_like(q), key_out=poisoned_like(k))
    q_ref, k_ref = reference.rotary_embedding(positions, q.float(), k.float(), cache)
    # bf16: one output rounding (the interpreter truncates: up to one bf16 ulp).
    rel = 1e-5 if dtype == torch.float32 else 2**-7
    assert_close(q_out, q_ref, rel, "query")
    assert_close(k_out, k_ref, rel, "key")


def test_rotary_in_place_int32_positions() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 64, generator=gen)
    k = torch.randn(9, 2, 64, generator=gen)
    positions = torch.arange(100, 109, dtype=torch.int32)
    cache = cos_sin_cache(512, 64)
    q_ref, k_ref = reference.rotary_embedding(positions.long(), q, k, cache)
    q_out, k_out = rotary_embedding(positions, q, k, cache, query_out=q, key_out=k)
    assert q_out is q and k_out is k
    assert_close(q, q_ref, 1e-5, "query in place")
    assert_close(k, k_ref, 1e-5, "key in place")


def test_rotary_preserves_norm_per_pair() -> None:
    """A rotation: each (x_i, x_{i + rot_dim/2}) pair keeps its length (a check not using the twin)."""
    q = torch.randn(5, 2, 64)
    k = torch.randn(5, 1, 64)
    q_out, _ = rotary_embedding(torch.arange(5), q, k, cos_sin_cache(8, 64))
    pair = lambda t: t[..., :32] ** 2 + t[..., 32:] ** 2  # noqa: E731
    assert torch.allclose(pair(q_out), pair(q), rtol=1e-5, atol=1e-5)
    assert math.isclose(float((q_out[0] - q[0]).abs().max()), 0.0, abs_tol=1e-6)  # position 0: identity


def test_rotary_rejects_odd_rot_dim() -> None:
    with pytest.raises(ValueError, match="rot_dim"):
        rotary_embedding(torch.arange(2), torch.randn(2, 1, 64), torch.randn(2, 1, 64), torch.randn(8, 63))
