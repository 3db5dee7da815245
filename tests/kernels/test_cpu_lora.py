"""kernels/cpu/lora.c (lora.py's lora) against its torch twin reference.lora_segments: the
multi-LoRA update per segment of tokens, with the blocks and ranks it skips by."""

from __future__ import annotations

import shutil

import pytest
import torch

from stoker.kernels import reference
from stoker.kernels.cpu import lora as cpu_lora

if not shutil.which("cc") and not shutil.which("gcc"):
    pytest.skip("no C compiler: the CPU kernels are not built here (the torch twin runs instead)", allow_module_level=True)


def slot_buffers(gen: torch.Generator, num_slots: int, shards: list[int], r: int, k: int,
                 ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (S, W, K) and BT (S, W, N) as layers/lora.py fills them: shard j's rank rows reach its
    columns only, rows past each slot's rank zero; and the (E, 4) blocks."""
    w, n = len(shards) * r, sum(shards)
    a = torch.zeros(num_slots, w, k)
    bt = torch.zeros(num_slots, w, n)
    blocks, first = [], 0
    for j, rows in enumerate(shards):
        for s, rank in enumerate(ranks):
            a[s, j * r:j * r + rank] = torch.randn(rank, k, generator=gen)
            bt[s, j * r:j * r + rank, first:first + rows] = torch.randn(rank, rows, generator=gen)
        blocks.append((j * r, (j + 1) * r, first, first + rows))
        first += rows
    return a, bt, torch.tensor(blocks, dtype=torch.int64)


@pytest.mark.parametrize("k, shards, r", [(64, [64, 32, 32], 16), (53, [70], 8), (40, [24, 9], 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_lora_matches_its_twin(k: int, shards: list[int], r: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(k)
    ranks = [r, r // 2, 0]  # a full slot, a smaller adapter, an empty slot
    a, bt, blocks = slot_buffers(gen, 3, shards, r, k, ranks)
    num_tokens, n = 23, sum(shards)
    x = torch.randn(num_tokens, k, generator=gen)
    base = torch.randn(num_tokens, n + 3, generator=gen)  # wider than N: columns past N untouched
    segments = [(1, 0, 5), (0, 5, 6), (2, 6, 9), (0, 12, 23)]  # tokens 9-11: the base model
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_lora.lora(x, a, bt, torch.tensor(segments), blocks, torch.tensor(ranks), base.clone())
    finally:
        torch.set_num_threads(previous)
    want = reference.lora_segments(x, a, bt, segments, base.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[9:12], base[9:12]) and torch.equal(got[:, n:], base[:, n:])
    assert torch.equal(got[6:9], base[6:9])  # slot 2 holds no adapter (rank 0)
    assert not torch.equal(got[0], base[0])


def test_lora_with_interleaved_columns() -> None:
    """A fused [gate; up] layer: BT's columns in the kernel's panel order, so each shard's block
    spans every column; a smaller adapter fills only the first rows of each shard's block."""
    gen = torch.Generator().manual_seed(3)
    a, bt, _ = slot_buffers(gen, 2, [32, 32], 16, 48, [16, 8])
    bt = bt[:, :, torch.randperm(64, generator=gen)].contiguous()
    blocks = torch.tensor([(0, 16, 0, 64), (16, 32, 0, 64)])
    x, base = torch.randn(9, 48, generator=gen), torch.randn(9, 64, generator=gen)
    segments = [(1, 0, 4), (0, 4, 9)]
    got = cpu_lora.lora(x, a, bt, torch.tensor(segments), blocks, torch.tensor([16, 8]), base.clone())
    torch.testing.assert_close(got, reference.lora_segments(x, a, bt, segments, base.clone()), rtol=1e-5, atol=1e-4)


def test_a_tokens_update_does_not_depend_on_its_neighbours() -> None:
    """Batch invariance: a token alone in its segment gets the same bits as in a run of 7."""
    gen = torch.Generator().manual_seed(5)
    a, bt, blocks = slot_buffers(gen, 2, [48, 16], 8, 72, [8, 8])
    x = torch.randn(7, 72, generator=gen)
    base = torch.randn(7, 64, generator=gen)
    ranks = torch.tensor([8, 8])
    together = cpu_lora.lora(x, a, bt, torch.tensor([(1, 0, 7)]), blocks, ranks, base.clone())
    for t in range(7):
        alone = cpu_lora.lora(x[t:t + 1], a, bt, torch.tensor([(1, 0, 1)]), blocks, ranks, base[t:t + 1].clone())
        assert torch.equal(alone[0], together[t])


def test_lora_refuses_what_does_not_chain() -> None:
    a, bt = torch.zeros(2, 8, 16), torch.zeros(2, 8, 32)
    blocks, ranks = torch.tensor([(0, 8, 0, 32)]), torch.tensor([8, 8])
    with pytest.raises(ValueError, match="do not chain"):
        cpu_lora.lora(torch.zeros(3, 15), a, bt, torch.tensor([(0, 0, 3)]), blocks, ranks, torch.zeros(3, 32))
    with pytest.raises(ValueError, match="int64"):
        cpu_lora.lora(torch.zeros(3, 16), a, bt, torch.tensor([(0, 0, 3)], dtype=torch.int32), blocks, ranks,
                      torch.zeros(3, 32))
