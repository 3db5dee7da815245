"""Expert parallelism at the layer: which experts a rank holds, and that the ranks' partial
outputs (what the all-reduce sums) give the whole layer's output, without processes (the
distributed engine is tests/distributed/test_moe_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from stoker.distributed.expert_partition import ExpertPartition
from stoker.layers.moe import FusedMoE, TorchMoEMethod
from stoker.layers.moe_load import ExpertTokenCounter
from tests.model.test_moe_layer import make_layer, random_routing


class _Partials:
    """A stand-in group: keeps each rank's partial output instead of all-reducing it."""

    world_size = 2

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return x


def ranks_of(whole: FusedMoE, num_ranks: int, group: _Partials) -> list[FusedMoE]:
    """The layer cut into `num_ranks` expert-parallel shards, each with its experts' weights."""
    layers = []
    for r in range(num_ranks):
        held = ExpertPartition(whole.global_num_experts, num_ranks, r)
        layer = FusedMoE(whole.global_num_experts, whole.hidden_size, whole.intermediate_size, tp=group, experts=held)  # type: ignore[arg-type]
        layer.attach(TorchMoEMethod())
        with torch.no_grad():
            layer.w13.copy_(whole.w13[held.start:held.stop])
            layer.w2.copy_(whole.w2[held.start:held.stop])
        layers.append(layer.to(whole.w13.dtype))
    return layers


def test_experts_are_dealt_out_as_vllm_does() -> None:
    parts = [ExpertPartition(60, 8, r) for r in range(8)]
    assert [p.size for p in parts] == [8, 8, 8, 8, 7, 7, 7, 7]  # the first E % N ranks hold one more
    assert [p.start for p in parts] == [0, 8, 16, 24, 32, 39, 46, 53] and parts[-1].stop == 60
    assert ExpertPartition(8, 2, 1).local(5) == 1 and not ExpertPartition(8, 2, 1).holds(3)
    with pytest.raises(ValueError, match="expert 3 is not held by rank 1"):
        ExpertPartition(8, 2, 1).local(3)
    with pytest.raises(ValueError, match="needs at least as many experts; the model has 2"):
        ExpertPartition(2, 4, 0)


def test_two_ranks_sum_to_the_whole_layer_bit_for_bit_with_k2() -> None:
    """k = 2: each token's sum is either (a + b) + 0 or a + b in some order: exact."""
    whole = make_layer(8, 32, 16)
    x = torch.randn(13, 32)
    weights, ids = random_routing(13, 8, 2, seed=3)
    group = _Partials()
    for layer in ranks_of(whole, 2, group):
        layer(x, weights, ids)
    assert len(group.seen) == 2
    assert torch.equal(group.seen[0] + group.seen[1], whole(x, weights, ids))


@pytest.mark.parametrize("num_experts, k, num_ranks", [(8, 3, 2), (6, 4, 4), (7, 2, 3)], ids=["k3", "k4-4ranks", "E7-3ranks"])
def test_ranks_sum_to_the_whole_layer(num_experts: int, k: int, num_ranks: int) -> None:
    """k > 2 regroups a token's sum by rank: equal within rounding; E need not divide."""
    whole = make_layer(num_experts, 24, 12)
    x = torch.randn(11, 24)
    weights, ids = random_routing(11, num_experts, k, seed=5)
    group = _Partials()
    for layer in ranks_of(whole, num_ranks, group):
        layer(x, weights, ids)
    torch.testing.assert_close(sum(group.seen[1:], group.seen[0]), whole(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_a_rank_no_token_chose_returns_zeros_and_still_reduces() -> None:
    whole = make_layer(4, 16, 8)
    x = torch.randn(5, 16)
    ids = torch.tensor([[0, 1]] * 5)  # every token on rank 0's experts
    weights = torch.full((5, 2), 0.5)
    group = _Partials()
    rank0, rank1 = ranks_of(whole, 2, group)
    with torch.no_grad():
        rank1.w13.fill_(float("nan"))  # never read: no pair is routed there
    rank0(x, weights, ids)
    rank1(x, weights, ids)
    assert len(group.seen) == 2 and torch.equal(group.seen[1], torch.zeros(5, 16))
    assert torch.equal(group.seen[0] + group.seen[1], whole(x, weights, ids))
    empty = torch.empty(0, 2, dtype=torch.int64)
    assert rank1(torch.empty(0, 16), torch.empty(0, 2), empty).shape == (0, 16)  # an empty step joins too


def test_a_token_is_the_same_alone_and_in_a_batch_under_expert_parallelism() -> None:
    """Batch invariance, where the method has it (the per-row computation does not depend on
    the other rows): a stand-in method whose GEMM is row by row."""

    class RowByRow(TorchMoEMethod):
        def expert_forward(self, layer, e, rows):  # type: ignore[no-untyped-def]
            return torch.cat([super(RowByRow, self).expert_forward(layer, e, r[None]) for r in rows]) if len(rows) else rows

    whole = make_layer(8, 32, 16)
    group = _Partials()
    layers = ranks_of(whole, 2, group)
    for layer in layers:
        layer.method = None
        w13, w2 = layer.w13, layer.w2
        layer.attach(RowByRow())
        layer.w13, layer.w2 = w13, w2
    x = torch.randn(9, 32)
    weights, ids = random_routing(9, 8, 2, seed=11)

    def out(rows: slice) -> torch.Tensor:
        group.seen.clear()
        for layer in layers:
            layer(x[rows], weights[rows], ids[rows])
        return group.seen[0] + group.seen[1]

    batch = out(slice(None))
    assert all(torch.equal(out(slice(t, t + 1))[0], batch[t]) for t in range(9))


def test_the_counter_counts_every_pair_per_expert() -> None:
    counter = ExpertTokenCounter(6)
    counter.record(torch.tensor([[0, 5], [5, 2], [0, 5]]))
    counter.record(torch.empty(0, 2, dtype=torch.int64))
    assert counter.read() == [2, 0, 1, 0, 0, 3]
    counter.reset()
    assert counter.read() == [0] * 6


def test_a_layer_counts_its_routing() -> None:
    layer = make_layer(4, 16, 8)
    ids = torch.tensor([[0, 3], [3, 1]])
    layer(torch.randn(2, 16), torch.full((2, 2), 0.5), ids)
    assert layer.expert_tokens.read() == [1, 1, 0, 2]


class _ReadSpy:
    """Wraps safetensors' handle: records each tensor whose bytes are read, and which part."""

    def __init__(self, handle, reads: list) -> None:  # type: ignore[no-untyped-def]
        self.handle, self.reads = handle, reads

    def keys(self):  # type: ignore[no-untyped-def]
        return self.handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        self.reads.append((name, None))
        return self.handle.get_tensor(name)

    def get_slice(self, name: str):  # type: ignore[no-untyped-def]
        spy, part = self, self.handle.get_slice(name)

        class Slice:
            def get_shape(self):  # type: ignore[no-untyped-def]
                return part.get_shape()

            def __getitem__(self, index):  # type: ignore[no-untyped-def]
                spy.reads.append((name, index))
                return part[index]

        return Slice()


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_a_rank_reads_only_its_experts(tiny_checkpoints, tmp_path, monkeypatch, layout: str) -> None:
    from contextlib import contextmanager

    from stoker.distributed.parallel_state import TensorParallelGroup
    from stoker.models import loader
    from tests.model.test_moe_loading import QWEN3_MOE, rewrite, stack_experts

    path = tiny_checkpoints("qwen3_moe", **QWEN3_MOE)
    if layout == "stacked":
        path = rewrite(path, tmp_path / "stacked", lambda t: stack_experts(t, 4))
    hf = loader.read_hf_config(path)
    whole = loader.build_model(hf, 128, torch.float32, torch.device("cpu"))
    loader.load_weights(whole, path)

    reads: list = []
    real_open = loader.safe_open

    @contextmanager
    def spying_open(*args, **kwargs):  # type: ignore[no-untyped-def]
        with real_open(*args, **kwargs) as f:
            yield _ReadSpy(f, reads)

    monkeypatch.setattr(loader, "safe_open", spying_open)
    tp = TensorParallelGroup(rank=1, world_size=2)  # no collective runs: build and load only
    tp.expert_parallel = True
    rank1 = loader.build_model(hf, 128, torch.float32, torch.device("cpu"), tp=tp)
    loader.load_weights(rank1, path)

    expert_reads = [(n, i) for n, i in reads if ".experts." in n]
    if layout == "per-expert":  # experts 2 and 3 only, each whole (not cut along I)
        assert expert_reads and all(n.split(".experts.")[1][0] in "23" and i is None for n, i in expert_reads)
    else:  # the stacked tensors through a slice of rows 2:4
        assert expert_reads and all(i == slice(2, 4) for _, i in expert_reads)
    pairs = [(a, b) for a, b in zip(whole.modules(), rank1.modules()) if isinstance(a, FusedMoE)]
    assert pairs and all(torch.equal(b.w13, a.w13[2:4]) and torch.equal(b.w2, a.w2[2:4]) for a, b in pairs)


def test_expert_parallelism_on_a_dense_model_is_refused(tiny_checkpoints) -> None:
    from stoker import LLM

    with pytest.raises(ValueError, match=r"expert parallelism \(--enable-expert-parallel\) is for Mixture-of-Experts "
                                         r"models; LlamaForCausalLM has no experts"):
        LLM(str(tiny_checkpoints("llama")), max_model_len=128, kv_cache_memory_bytes=1 << 20, device="cpu",
            enable_expert_parallel=True)
