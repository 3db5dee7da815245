"""Triton absorbed MLA decode (split-K over a paged latent cache) vs reference.mla_decode_attention,
interpreter on CPU: odd context lengths, several sequences, shuffled block tables padded with
block 0 and NaN in every slot outside a context (paged_cases), float32 / bf16 / FP8 caches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import assert_close, make_paged_batch  # noqa: E402

from stoker.kernels import mla_decode_attention as mla_mod  # noqa: E402
from stoker.kernels import reference  # noqa: E402


@pytest.fixture(autouse=True)
def _poison_split_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split partials start as NaN, so a partial the reduce reads but no split wrote shows up."""
    monkeypatch.setattr(mla_mod, "_workspace", lambda shape, device: torch.full(shape, float("nan"), device=device))


def run_case(context_lens: list[int], num_heads: int, rank: int, rope: int, block_size: int, num_splits: int | None,
             dtype: torch.dtype = torch.float32, fp8: bool = False, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(context_lens, 1, rank + rope, block_size, dtype, "cpu", gen)
    cache, k_scale = batch.k_cache, 1.0
    if fp8:  # values spread over the e4m3 range, read back through a scale
        k_scale = 0.05
        cache = (batch.k_cache.float() / k_scale).to(torch.float8_e4m3fn)
    query = torch.randn(len(context_lens), num_heads, rank + rope, generator=gen).to(dtype)
    scale = (rank + rope) ** -0.5
    ctx = batch.context_lens_tensor()
    out = mla_mod.mla_decode_attention(query, cache, batch.block_tables, ctx, rank, scale, k_scale, num_splits=num_splits)
    ref = reference.mla_decode_attention(query.float(), cache, batch.block_tables, ctx, rank, scale, k_scale)
    assert out.dtype == torch.float32 and out.shape == (len(context_lens), num_heads, rank)
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 2e-2, f"mla decode {context_lens} {dtype} fp8={fp8}")


@pytest.mark.parametrize(
    "context_lens, num_heads, rank, rope, block_size, num_splits",
    [
        ([1, 17, 100], 4, 32, 8, 16, None),  # a one-token context, partial last blocks, 4 of 16 heads used
        ([33, 64, 5], 16, 64, 16, 32, 4),  # a full head tile; splits that a 5-token context leaves empty
        ([301, 7], 20, 32, 8, 16, 8),  # two head tiles (20 = 16 + 4), a long context in 8 splits
        ([45, 31, 2, 90], 3, 48, 8, 16, 2),  # rank 48 and rope 8: both tiles padded
    ],
)
def test_mla_decode_matches_twin(context_lens, num_heads, rank, rope, block_size, num_splits) -> None:
    run_case(context_lens, num_heads, rank, rope, block_size, num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_mla_decode_fp8_cache(num_splits) -> None:
    run_case([70, 9, 129], 8, 32, 8, 16, num_splits, fp8=True, seed=1)


def test_mla_decode_bf16_interpreted() -> None:
    run_case([50, 130], 8, 64, 16, 16, 2, dtype=torch.bfloat16, seed=2)


def test_mla_decode_zero_context_gives_zeros() -> None:
    batch = make_paged_batch([20], 1, 40, 16, torch.float32, "cpu", torch.Generator().manual_seed(3))
    q = torch.randn(2, 4, 40)
    tables = torch.cat([batch.block_tables, torch.zeros_like(batch.block_tables)])
    for num_splits in (1, 2):
        out = mla_mod.mla_decode_attention(q, batch.k_cache, tables, torch.tensor([20, 0], dtype=torch.int32), 32,
                                           0.2, num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros(4, 32))
        ref = reference.mla_decode_attention(q[:1], batch.k_ref, batch.block_tables, torch.tensor([20]), 32, 0.2)
        assert_close(out[:1], ref, 1e-5, "beside an empty context")


def test_num_splits_fill_the_gpu() -> None:
    cpu = torch.device("cpu")  # the interpreter assumes 132 SMs (H100/H200)
    assert mla_mod.pick_num_splits(1, 128, 32768, 32, cpu) == 16  # batch 1, V3's 128 heads: 8 tiles x 16
    assert mla_mod.pick_num_splits(64, 128, 32768, 32, cpu) == 1  # 512 programs already
    assert mla_mod.pick_num_splits(1, 16, 64, 32, cpu) == 1  # a short context: nothing to split


def test_mla_decode_rejects_bad_arguments() -> None:
    q = torch.randn(2, 4, 40)
    cache = torch.zeros(4, 16, 1, 40)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    ctx = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="width 48 != query width 40"):
        mla_mod.mla_decode_attention(q, torch.zeros(4, 16, 1, 48), tables, ctx, 32, 1.0)
    with pytest.raises(ValueError, match="int32"):
        mla_mod.mla_decode_attention(q, cache, tables.long(), ctx, 32, 1.0)
    with pytest.raises(ValueError, match="kv_lora_rank 40"):
        mla_mod.mla_decode_attention(q, cache, tables, ctx, 40, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        mla_mod.mla_decode_attention(q, cache, tables, ctx, 32, 1.0, num_splits=3)
    with pytest.raises(ValueError, match="latent cache dtype"):
        mla_mod.mla_decode_attention(q, cache.bfloat16(), tables, ctx, 32, 1.0)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        mla_mod.mla_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), cache, tables, ctx, 32, 1.0)
