"""The C paged decode attention for CPU (stoker/kernels/cpu) vs reference.paged_decode_attention.

The cache the C kernel reads holds NaN in every slot outside each sequence's attended range
(paged_cases.make_paged_batch), so reading a slot it should not turns its output NaN.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged_cases import NAN, assert_close, make_paged_batch, spy_cpu_kernels

from stoker.kernels import ops, reference
from stoker.kernels.cpu import build as cpu_build
from stoker.kernels.cpu import paged_decode_attention as cpu_decode

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here (the torch twins run instead)", allow_module_level=True)


def run_case(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(context_lens, num_kv_heads, head_dim, block_size, torch.float32, "cpu", gen)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    if sliding_window is not None:  # positions before each window must not be read either
        for s, ctx in enumerate(context_lens):
            for pos in range(max(0, ctx - sliding_window)):
                block = int(batch.block_tables[s, pos // block_size])
                k_cache[block, pos % block_size] = NAN
                v_cache[block, pos % block_size] = NAN
    query = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    scale = 1.0 / math.sqrt(head_dim)
    ctx = batch.context_lens_tensor()
    out = cpu_decode.paged_decode_attention(query, k_cache, v_cache, batch.block_tables, ctx, scale, sliding_window)
    ref = reference.paged_decode_attention(query, batch.k_ref, batch.v_ref, batch.block_tables, ctx, scale, sliding_window)
    assert_close(out, ref, 1e-5, f"cpu decode {context_lens}")
    return out


@pytest.mark.parametrize(
    "context_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window",
    [
        ([1, 17, 100], 4, 4, 64, 16, None),  # MHA, a one-token context, partial last blocks
        ([33, 64, 5], 8, 2, 128, 32, 24),  # GQA 4, head_dim 128, block 32, sliding window
        ([2047, 300], 8, 1, 64, 16, None),  # MQA at a long context
        ([70, 9, 129], 16, 2, 64, 32, 50),  # window longer than some contexts
        ([45, 31], 6, 2, 80, 16, None),  # group of 3, head_dim 80
        # Enough sequences for one task per sequence (the other split is per KV head).
        ([1 + (37 * i) % 400 for i in range(24)], 8, 4, 64, 16, None),
        ([1 + (53 * i) % 300 for i in range(20)], 12, 4, 96, 16, 100),
    ],
)
def test_matches_twin(
    context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int | None
) -> None:
    run_case(context_lens, num_heads, num_kv_heads, head_dim, block_size, sliding_window)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    context_lens=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    kv_heads_and_group=st.sampled_from([(1, 1), (2, 2), (4, 2), (1, 8), (2, 3)]),
    head_dim=st.sampled_from([16, 64, 80]),
    block_size=st.sampled_from([1, 8, 16]),
    sliding_window=st.one_of(st.none(), st.integers(1, 200)),
    seed=st.integers(0, 1000),
)
def test_matches_twin_random(
    context_lens: list[int], kv_heads_and_group: tuple[int, int], head_dim: int, block_size: int,
    sliding_window: int | None, seed: int,
) -> None:
    num_kv_heads, group = kv_heads_and_group
    run_case(context_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, sliding_window, seed)


def test_same_result_on_one_thread() -> None:
    """A task (sequence or KV head) is done by one thread in a fixed order: thread count must
    not change a single bit, or batch-invariant seeded sampling would not hold."""
    lens = [1 + (41 * i) % 500 for i in range(16)]
    on_all = run_case(lens, 8, 4, 64, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        on_one = run_case(lens, 8, 4, 64, 16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(on_all, on_one)


def test_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 CPU decode takes the C kernel; the env var, or another dtype, takes the twin."""
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([20, 35], 2, 64, 16, torch.float32, "cpu", gen)
    q = torch.randn(2, 4, 64, generator=gen)
    args = (batch.k_ref, batch.v_ref, batch.block_tables, batch.context_lens_tensor(), 0.125, None)
    calls: list[str] = []
    spy_cpu_kernels(monkeypatch, ("paged_decode_attention",), calls)
    ops.paged_decode_attention(q, *args)
    assert calls == ["paged_decode_attention"]
    ops.paged_decode_attention(q.to(torch.bfloat16), batch.k_ref.to(torch.bfloat16), batch.v_ref.to(torch.bfloat16), *args[2:])
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    assert torch.equal(ops.paged_decode_attention(q, *args), reference.paged_decode_attention(q, *args))
    assert calls == ["paged_decode_attention"]


def test_rejects_indices_outside_the_cache() -> None:
    gen = torch.Generator().manual_seed(4)
    batch = make_paged_batch([20, 35], 2, 64, 16, torch.float32, "cpu", gen)
    q = torch.randn(2, 4, 64, generator=gen)
    bad_tables = batch.block_tables.clone()
    bad_tables[1, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="outside"):
        cpu_decode.paged_decode_attention(q, batch.k_cache, batch.v_cache, bad_tables, batch.context_lens_tensor(), 0.1)
    bad_tables = batch.block_tables.clone()
    bad_tables[0, 1] = -1
    with pytest.raises(ValueError, match="outside"):
        cpu_decode.paged_decode_attention(q, batch.k_cache, batch.v_cache, bad_tables, batch.context_lens_tensor(), 0.1)
    # entries past a sequence's last block are never read, so they may hold anything (padding)
    bad_tables[0, 1] = batch.block_tables[0, 1]
    bad_tables[0, -1] = -1
    out = cpu_decode.paged_decode_attention(q, batch.k_cache, batch.v_cache, bad_tables, batch.context_lens_tensor(), 0.1)
    assert not out.isnan().any()
    for lens in ([20, 16 * batch.block_tables.shape[1] + 1], [-1, 35]):
        with pytest.raises(ValueError, match="block table"):
            cpu_decode.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, torch.tensor(lens, dtype=torch.int32), 0.1)


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """An empty kernel cache and no loaded library; the real one is restored afterwards."""
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path))
    cpu_build.library.cache_clear()
    yield tmp_path
    cpu_build.library.cache_clear()


def test_build_is_cached_and_atomic(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = cpu_build.build()
    assert lib.is_file() and lib.parent.parent == fresh_build / "kernels"
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temporaries left behind

    def no_compiler(cmd, **kwargs):
        if "--version" in cmd:
            return real_run(cmd, **kwargs)
        raise AssertionError(f"rebuilt although cached: {cmd}")

    real_run = cpu_build.subprocess.run
    monkeypatch.setattr(cpu_build.subprocess, "run", no_compiler)
    assert cpu_build.build() == lib


def test_failed_build_falls_back_to_the_twin(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = fresh_build / "broken.c"
    broken.write_text("this is not C\n")
    with pytest.raises(cpu_build.BuildError, match="failed"):
        cpu_build.build((broken,))
    assert not list((fresh_build / "kernels").rglob("*.so")), "a failed build must leave no library"

    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert not cpu_build.available()
    assert "torch path" in caplog.text and "no C compiler" in caplog.text
    gen = torch.Generator().manual_seed(5)
    batch = make_paged_batch([9], 1, 16, 8, torch.float32, "cpu", gen)
    q = torch.randn(1, 1, 16, generator=gen)
    args = (q, batch.k_ref, batch.v_ref, batch.block_tables, batch.context_lens_tensor(), 0.25, None)
    assert torch.equal(ops.paged_decode_attention(*args), reference.paged_decode_attention(*args))


def test_unwritable_cache_dir_builds_in_temp(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = fresh_build / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("STOKER_CACHE_DIR", str(blocker))  # mkdir under a file fails
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", str(fresh_build / "tmp"))
    (fresh_build / "tmp").mkdir()
    lib = cpu_build.build()
    assert lib.is_file() and (fresh_build / "tmp") in lib.parents
    assert cpu_build.available()


def test_batch_invariant() -> None:
    """A sequence's output does not depend on what else is in the batch (nor on whether tasks
    are split per sequence or per KV head): seeded sampling relies on it."""
    gen = torch.Generator().manual_seed(6)
    lens = [1 + (61 * i) % 333 for i in range(20)]
    batch = make_paged_batch(lens, 2, 64, 16, torch.float32, "cpu", gen)
    q = torch.randn(len(lens), 8, 64, generator=gen)
    ctx = batch.context_lens_tensor()
    whole = cpu_decode.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, ctx, 0.125)
    for s in (0, 7, 19):
        alone = cpu_decode.paged_decode_attention(
            q[s : s + 1], batch.k_cache, batch.v_cache, batch.block_tables[s : s + 1], ctx[s : s + 1], 0.125
        )
        assert torch.equal(alone[0], whole[s])


def test_rejects_mismatched_arguments() -> None:
    gen = torch.Generator().manual_seed(7)
    batch = make_paged_batch([20, 35], 2, 64, 16, torch.float32, "cpu", gen)
    q = torch.randn(2, 4, 64, generator=gen)
    ctx = batch.context_lens_tensor()
    with pytest.raises(ValueError, match="float32 or fp8 caches only"):
        cpu_decode.paged_decode_attention(q, batch.k_cache, batch.v_cache.double(), batch.block_tables, ctx, 0.1)
    with pytest.raises(ValueError, match="2 queries"):
        cpu_decode.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables[:1], ctx, 0.1)
    with pytest.raises(ValueError, match="shape mismatch"):
        cpu_decode.paged_decode_attention(q[:, :3], batch.k_cache, batch.v_cache, batch.block_tables, ctx, 0.1)
