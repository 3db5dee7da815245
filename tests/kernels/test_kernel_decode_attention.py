"""Triton paged decode attention (split-K) vs reference.paged_decode_attention, interpreter on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from paged_cases import assert_close, make_paged_batch, poisoned_like  # noqa: E402

from stoker.kernels import paged_decode_attention as decode_mod  # noqa: E402
from stoker.kernels import reference  # noqa: E402


@pytest.fixture(autouse=True)
def _poison_split_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split partials start as NaN, so a partial the reduce reads but no split wrote shows up."""
    monkeypatch.setattr(
        decode_mod, "_workspace", lambda shape, device: torch.full(shape, float("nan"), device=device)
    )


def run_case(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None,
    num_splits: int | None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(context_lens, num_kv_heads, head_dim, block_size, dtype, "cpu", gen)
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    ctx = batch.context_lens_tensor()
    out = decode_mod.paged_decode_attention(
        query, batch.k_cache, batch.v_cache, batch.block_tables, ctx, scale, sliding_window,
        out=poisoned_like(query), num_splits=num_splits,
    )
    # Ground truth in float32 on the same (possibly bf16-rounded) inputs.
    ref = reference.paged_decode_attention(
        query.float(), batch.k_ref, batch.v_ref, batch.block_tables, ctx, scale, sliding_window
    )
    assert out.dtype == dtype
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 2e-2, f"decode {context_lens}")


@pytest.mark.parametrize(
    "context_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, num_splits",
    [
        # GQA 1, a one-token context, partial last blocks; splits from the heuristic.
        ([1, 17, 100], 4, 4, 64, 16, None, None),
        # GQA 4, head_dim 128, block 32; the window empties the first splits (lse = -inf path).
        ([33, 64, 5], 8, 2, 128, 32, 24, 4),
        # GQA 8 at a long context: 2047 tokens (partial last block) in 8 splits, beside a short one.
        ([2047, 300], 8, 1, 64, 16, None, 8),
        # GQA 8, single pass (no reduce), window longer than some contexts.
        ([70, 9, 129], 16, 2, 64, 32, 50, 1),
        # Group of 3 and head_dim 80: padding of both the head group and head_dim tiles.
        ([45, 31], 6, 2, 80, 16, None, 2),
    ],
)
def test_decode_matches_twin(
    context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    sliding_window: int | None, num_splits: int | None,
) -> None:
    run_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window, num_splits)


def test_decode_bf16_interpreted() -> None:
    run_case([50, 130], 8, 2, 64, 16, None, 2, dtype=torch.bfloat16)


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    context_lens=st.lists(st.integers(1, 200), min_size=1, max_size=4),
    group=st.sampled_from([1, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([64, 128]),
    block_size=st.sampled_from([16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 150)),
    num_splits=st.sampled_from([None, 1, 2, 4]),
)
def test_decode_random_shapes(
    context_lens: list[int], group: int, num_kv_heads: int, head_dim: int, block_size: int,
    sliding_window: int | None, num_splits: int | None,
) -> None:
    run_case(context_lens, group * num_kv_heads, num_kv_heads, head_dim, block_size, sliding_window, num_splits)


def test_decode_strided_query_and_zero_context() -> None:
    """A query sliced out of a fused qkv buffer works; context_len 0 (a padded graph slot) gives zeros."""
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([20, 1], 2, 64, 16, torch.float32, "cpu", gen)
    qkv = torch.randn(3, (4 + 2 * 2) * 64, generator=gen)
    query = qkv[:, : 4 * 64].view(3, 4, 64)
    block_tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables[:1])])
    ctx = torch.tensor([20, 1, 0], dtype=torch.int32)
    for num_splits in (1, 2):
        out = decode_mod.paged_decode_attention(
            query, batch.k_cache, batch.v_cache, block_tables, ctx, 0.125, out=poisoned_like(query), num_splits=num_splits
        )
        ref = reference.paged_decode_attention(query[:2], batch.k_ref, batch.v_ref, batch.block_tables, ctx[:2], 0.125)
        assert_close(out[:2], ref, 1e-5, "strided query")
        assert torch.equal(out[2], torch.zeros(4, 64))


def test_num_splits_heuristic_fills_the_gpu() -> None:
    cpu = torch.device("cpu")  # the interpreter assumes 132 SMs, like an H100/H200
    assert decode_mod._pick_num_splits(1, 8, 32768, 64, cpu) == 32  # batch 1: 8 x 32 programs ~ 2 per SM
    assert decode_mod._pick_num_splits(1, 1, 32768, 64, cpu) == 64  # MQA: capped at 64
    assert decode_mod._pick_num_splits(256, 8, 32768, 64, cpu) == 1  # big batch: one pass
    assert decode_mod._pick_num_splits(1, 8, 64, 64, cpu) == 1  # short context: nothing to split
    # a graph's block table as wide as max_model_len 2240: one 64-token step per split, not four
    assert decode_mod._pick_num_splits(1, 8, 2240, 64, cpu) == 32
    assert decode_mod._pick_num_splits(1, 8, 512, 64, cpu) == 8


def test_decode_rejects_bad_arguments() -> None:
    q = torch.randn(2, 8, 64)
    kc = torch.zeros(4, 16, 3, 64)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    ctx = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_mod.paged_decode_attention(q, kc, kc, bt, ctx, 1.0)
    kc = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="int32"):
        decode_mod.paged_decode_attention(q, kc, kc, bt.long(), ctx, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        decode_mod.paged_decode_attention(q, kc, kc, bt, ctx, 1.0, num_splits=3)
    with pytest.raises(ValueError, match="cache dtype"):
        decode_mod.paged_decode_attention(q, kc.bfloat16(), kc.bfloat16(), bt, ctx, 1.0)
