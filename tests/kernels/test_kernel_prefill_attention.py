"""Triton paged prefill/extend attention vs reference.paged_attention, interpreter on CPU.

Each case is a list of (context_len, q_len) per sequence: q_len == context_len is a fresh
prefill, q_len == 1 a decode, 1 < q_len < context_len an extend (a prefix-cache hit or a later
chunk of a chunked prefill), all packed into one batch as the runner sends them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from paged_cases import assert_close, make_paged_batch, poisoned_like  # noqa: E402

from stoker.kernels import reference  # noqa: E402
from stoker.kernels.paged_prefill_attention import paged_attention  # noqa: E402


def run_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
    as_tensors: bool = False,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    context_lens = [c for c, _ in seqs]
    cu = [0]
    for _, q_len in seqs:
        cu.append(cu[-1] + q_len)
    batch = make_paged_batch(context_lens, num_kv_heads, head_dim, block_size, dtype, "cpu", gen)
    # pad_tokens rows past cu[-1] stand for CUDA-graph padding: the kernel must leave them alone.
    query = torch.randn(cu[-1] + pad_tokens, num_heads, head_dim, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    cu_arg = torch.tensor(cu) if as_tensors else cu  # int64 tensors, as a runner may pass them
    ctx_arg = torch.tensor(context_lens) if as_tensors else context_lens
    out = paged_attention(
        query, batch.k_cache, batch.v_cache, batch.block_tables, cu_arg, ctx_arg, scale, sliding_window,
        out=poisoned_like(query),
    )
    ref = reference.paged_attention(
        query[: cu[-1]].float(), batch.k_ref, batch.v_ref, batch.block_tables, cu, context_lens, scale, sliding_window
    )
    assert out.dtype == dtype
    assert_close(out[: cu[-1]], ref, 1e-5 if dtype == torch.float32 else 2e-2, f"prefill {seqs}")
    assert torch.isnan(out[cu[-1] :].float()).all(), "padding rows were written"


@pytest.mark.parametrize(
    "seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window",
    [
        # GQA 1: decodes, a fresh prefill, extends after prefix hits, a 1-token prompt.
        ([(9, 1), (40, 40), (77, 13), (1, 1), (33, 2)], 2, 2, 64, 16, None),
        # GQA 4, head_dim 128, block 32, sliding window.
        ([(70, 70), (100, 1), (65, 30)], 8, 2, 128, 32, 20),
        # GQA 8: the last 64-token chunk of a 2043-token chunked prefill, beside a decode.
        ([(2043, 64), (300, 1)], 8, 1, 64, 16, None),
        # Group of 3 (BLOCK_Q = 21 tokens) and head_dim 80.
        ([(50, 50), (23, 5)], 6, 2, 80, 16, 16),
    ],
)
def test_prefill_matches_twin(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    sliding_window: int | None,
) -> None:
    run_case(seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window)


def test_prefill_bf16_interpreted() -> None:
    run_case([(40, 40), (90, 7), (12, 1)], 8, 2, 64, 32, None, dtype=torch.bfloat16)


def test_prefill_padding_rows_tensor_metadata_and_empty_sequence() -> None:
    """Rows past cu_seqlens_q[-1] untouched; int64 tensor metadata; a sequence with no new tokens."""
    run_case([(30, 30), (17, 0), (45, 3)], 4, 1, 64, 16, None, pad_tokens=5, as_tensors=True)


@st.composite
def packed_batches(draw: st.DrawFn) -> list[tuple[int, int]]:
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        ctx = draw(st.integers(1, 160))
        seqs.append((ctx, draw(st.sampled_from([1, ctx, draw(st.integers(1, ctx))]))))
    return seqs


@settings(max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    seqs=packed_batches(),
    group=st.sampled_from([1, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([64, 128]),
    block_size=st.sampled_from([16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 100)),
)
def test_prefill_random_shapes(
    seqs: list[tuple[int, int]], group: int, num_kv_heads: int, head_dim: int, block_size: int,
    sliding_window: int | None,
) -> None:
    run_case(seqs, group * num_kv_heads, num_kv_heads, head_dim, block_size, sliding_window)


def test_prefill_rejects_bad_arguments() -> None:
    q = torch.randn(5, 4, 64)
    kc = torch.zeros(4, 16, 2, 64)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="B \\+ 1"):
        paged_attention(q, kc, kc, bt, [0, 5], [5, 3], 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention(q, kc, kc, bt, [0, 2, 5], [5], 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(torch.randn(5, 4, 32), kc, kc, bt, [0, 2, 5], [5, 3], 1.0)
