"""The C paged prefill attention for CPU (stoker/kernels/cpu/prefill_attention.c) vs its twin,
reference.paged_attention. Each case is a list of (context_len, q_len) per sequence: fresh
prefills (q_len == context_len), extends after prefix hits or earlier chunks, decodes; the
cache holds NaN outside every context, so a read of a slot it should not touch fails."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged_cases import assert_close, make_paged_batch, spy_cpu_kernels

from stoker.kernels import ops, reference
from stoker.kernels.cpu import prefill_attention as cpu_prefill

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here (the torch twins run instead)", allow_module_level=True)


def run_case(seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window, seed=0) -> None:
    gen = torch.Generator().manual_seed(seed)
    context_lens = [c for c, _ in seqs]
    cu = [0]
    for _, q_len in seqs:
        cu.append(cu[-1] + q_len)
    batch = make_paged_batch(context_lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu", gen)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen)
    scale = 1.0 / math.sqrt(head_dim)
    out = cpu_prefill.paged_attention(query, batch.k_cache, batch.v_cache, batch.block_tables, cu, context_lens, scale, sliding_window)
    ref = reference.paged_attention(query, batch.k_ref, batch.v_ref, batch.block_tables, cu, context_lens, scale, sliding_window)
    assert_close(out, ref, 1e-5, f"prefill {seqs}")


@pytest.mark.parametrize(
    "seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window",
    [
        ([(9, 1), (40, 40), (77, 13), (1, 1), (33, 2)], 2, 2, 64, 16, None),  # MHA, mixed kinds
        ([(70, 70), (100, 1), (65, 30)], 8, 2, 128, 32, 20),  # GQA 4, head_dim 128, block 32, window
        ([(300, 300), (2043, 64)], 8, 1, 64, 16, None),  # MQA; several 64-row chunks; a late chunk
        ([(50, 50), (23, 5)], 6, 2, 80, 16, 16),  # group of 3, head_dim 80 (two panels: 64 + 16)
        ([(130, 130)], 4, 4, 32, 1, 7),  # block size 1, window shorter than a tile
    ],
)
def test_matches_twin(seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window) -> None:
    run_case(seqs, num_heads, num_kv_heads, head_dim, block_size, sliding_window)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 150), st.integers(1, 150)), min_size=1, max_size=4),
    kv_heads_and_group=st.sampled_from([(1, 1), (2, 2), (1, 4), (3, 1)]),
    head_dim=st.sampled_from([16, 64]),
    block_size=st.sampled_from([1, 8, 16]),
    sliding_window=st.one_of(st.none(), st.integers(1, 64)),
    seed=st.integers(0, 2**16),
)
def test_matches_twin_property(lens, kv_heads_and_group, head_dim, block_size, sliding_window, seed) -> None:
    seqs = [(max(c, q), min(c, q)) for c, q in lens]  # q_len <= context_len
    num_kv_heads, group = kv_heads_and_group
    run_case(seqs, num_kv_heads * group, num_kv_heads, head_dim, block_size, sliding_window, seed)


def test_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 CPU takes the C kernel; a head_dim off the vector width, or the env var, the twin."""
    calls: list[str] = []
    spy_cpu_kernels(monkeypatch, ("paged_attention",), calls)
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([20], 1, 64, 16, torch.float32, "cpu", gen)
    q = torch.randn(20, 2, 64, generator=gen)
    args = (batch.k_ref, batch.v_ref, batch.block_tables, [0, 20], [20], 0.125)
    ops.paged_attention(q, *args)
    assert calls == ["paged_attention"]
    odd = make_paged_batch([20], 1, 20, 16, torch.float32, "cpu", gen)
    ops.paged_attention(torch.randn(20, 2, 20), odd.k_ref, odd.v_ref, odd.block_tables, [0, 20], [20], 0.2)
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    ops.paged_attention(q, *args)
    assert calls == ["paged_attention"]


def test_bad_input_is_refused() -> None:
    gen = torch.Generator().manual_seed(4)
    batch = make_paged_batch([20, 35], 1, 64, 16, torch.float32, "cpu", gen)
    q = torch.randn(10, 2, 64)
    args = (q, batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="query rows"):
        cpu_prefill.paged_attention(*args, batch.block_tables, [0, 5, 11], [20, 35], 0.1)  # past the query
    with pytest.raises(ValueError, match="context_len"):
        cpu_prefill.paged_attention(*args, batch.block_tables, [0, 5, 10], [4, 35], 0.1)  # more rows than context
    bad = batch.block_tables.clone()
    bad[1, 1] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="outside"):
        cpu_prefill.paged_attention(*args, bad, [0, 5, 10], [20, 35], 0.1)
