"""FusedMoE and its float method against the expert-by-expert twin (kernels/reference.fused_moe),
the softmax top-k router against its definition, and the loading of expert shards."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import reference
from stoker.layers.moe import FusedMoE, TorchMoEMethod, group_by_expert
from stoker.layers.moe_router import SoftmaxTopKRouter, softmax_topk


def make_layer(num_experts: int, hidden: int, inter: int, seed: int = 0, dtype=torch.float32) -> FusedMoE:
    torch.manual_seed(seed)
    layer = FusedMoE(num_experts, hidden, inter)
    layer.attach(TorchMoEMethod())
    with torch.no_grad():
        layer.w13.copy_(torch.randn(num_experts, 2 * inter, hidden) * 0.2)
        layer.w2.copy_(torch.randn(num_experts, hidden, inter) * 0.2)
    return layer.to(dtype)


def random_routing(num_tokens: int, num_experts: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    return softmax_topk(logits, k, renormalize=False)


@pytest.mark.parametrize(
    "num_experts, k, hidden, inter, num_tokens",
    [(1, 1, 16, 8, 5), (4, 4, 16, 8, 9), (8, 2, 33, 17, 7), (6, 3, 64, 40, 1), (16, 2, 24, 12, 3), (8, 2, 32, 16, 0)],
    ids=["E=1", "k=E", "odd-sizes", "one-token", "most-experts-idle", "no-tokens"],
)
def test_layer_matches_the_per_expert_loop(num_experts, k, hidden, inter, num_tokens) -> None:
    layer = make_layer(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden)
    weights, ids = random_routing(num_tokens, num_experts, k)
    ours = layer(x, weights, ids)
    ref = reference.fused_moe(x, layer.w13, layer.w2, weights, ids)
    assert ours.shape == (num_tokens, hidden)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_an_expert_no_token_chose_is_skipped() -> None:
    layer = make_layer(4, 16, 8)
    x = torch.randn(6, 16)
    ids = torch.tensor([[0, 2]] * 3 + [[2, 3]] * 3)  # expert 1 idle
    weights = torch.full((6, 2), 0.5)
    groups = group_by_expert(weights, ids, 4)
    assert [e for e, _, _ in groups.segments] == [0, 2, 3]
    with torch.no_grad():
        layer.w13[1].fill_(float("nan"))  # never read
    torch.testing.assert_close(layer(x, weights, ids), reference.fused_moe(x, layer.w13, layer.w2, weights, ids))


def test_each_token_is_summed_in_expert_order_whatever_its_slot_order() -> None:
    # The k choices of a token may come in any order from the router: its row is the same bits.
    layer = make_layer(8, 32, 16)
    x = torch.randn(9, 32)
    weights, ids = random_routing(9, 8, 3, seed=3)
    assert torch.equal(layer(x, weights.flip(1), ids.flip(1)), layer(x, weights, ids))


def test_a_token_alone_equals_its_row_in_a_batch() -> None:
    # Bit-for-bit only where the GEMM is row-invariant (the C kernels); torch's matmul is close.
    layer = make_layer(8, 32, 16)
    x = torch.randn(9, 32)
    weights, ids = random_routing(9, 8, 3, seed=3)
    whole = layer(x, weights, ids)
    for t in (0, 4, 8):
        torch.testing.assert_close(layer(x[t : t + 1], weights[t : t + 1], ids[t : t + 1])[0], whole[t])


def test_bfloat16_model_routes_in_float32() -> None:
    from stoker.layers.weight_method import TorchLinearMethod

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as build_model does for a bf16 model
    try:
        router = SoftmaxTopKRouter(16, 4, 2, renormalize=True)
        router.attach(TorchLinearMethod())
    finally:
        torch.set_default_dtype(previous)
    assert router.weight.dtype == torch.float32
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 16))
    weights, ids = router.route(torch.randn(5, 16, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk(renormalize: bool) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = softmax_topk(logits, 2, renormalize)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]]
    want = probs[[1, 2]] / (probs[1] + probs[2]) if renormalize else probs[[1, 2]]
    torch.testing.assert_close(weights[0], want)


def test_top_k_above_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        SoftmaxTopKRouter(16, 4, 5, renormalize=True)


def test_shards_load_into_their_rows() -> None:
    layer = FusedMoE(3, 8, 4)
    method = TorchMoEMethod()
    layer.attach(method)
    w1, w3, w2 = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 4)
    method.load(layer, 2, "w1", w1)
    method.load(layer, 2, "w3", w3)
    method.load(layer, 2, "w2", w2)
    assert torch.equal(layer.w13[2], torch.cat([w1, w3])) and torch.equal(layer.w2[2], w2)
    with pytest.raises(ValueError, match=r"w1.*expert 1.*\(5, 8\).*\(4, 8\)"):
        method.load(layer, 1, "w1", torch.randn(5, 8))
    with pytest.raises(ValueError, match="expert 3 does not exist"):
        method.load(layer, 3, "w2", w2)
    with pytest.raises(ValueError, match="unquantized"):
        method.load(layer, 0, "w2", w2.to(torch.float8_e4m3fn))


def test_a_tensor_parallel_rank_reads_its_columns_of_i() -> None:
    from stoker.distributed.parallel_state import TensorParallelGroup
    from stoker.distributed.partition import Partition

    layer = FusedMoE(2, 8, 6, split=Partition(2, 1), tp=TensorParallelGroup.single())
    assert layer.intermediate_size == 3
    assert layer.checkpoint_slice("w1", (6, 8)) == (slice(3, 6),)
    assert layer.checkpoint_slice("w2", (8, 6)) == (slice(None), slice(3, 6))
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.checkpoint_slice("w3", (8, 6))


@pytest.mark.parametrize("inter, fuse", [(32, True), (40, False), (17, False)], ids=["fused-silu", "unfused", "odd-I"])
@pytest.mark.parametrize("twin", [False, True], ids=["c-kernel", "torch-twin"])
def test_packed_cpu_method_matches_the_loop(inter: int, fuse: bool, twin: bool) -> None:
    from stoker.kernels.cpu import build

    if not build.available():
        pytest.skip("the C kernels are not built on this machine")
    from stoker.kernels.cpu import linear as cpu_linear
    from stoker.layers.moe import PackedCpuMoEMethod

    if fuse and not cpu_linear.gate_up_fusable(inter):
        pytest.skip(f"I = {inter} does not fill whole panels of this build")
    torch.manual_seed(0)
    w13, w2 = torch.randn(6, 2 * inter, 48) * 0.2, torch.randn(6, 48, inter) * 0.2
    layer = FusedMoE(6, 48, inter)
    method = PackedCpuMoEMethod(fuse)
    if twin:  # the per-expert loop, on the linear kernel's twin
        method.kernel = reference.linear_packed
        method.fused_moe = None
    layer.attach(method)
    for e in range(6):
        method.load(layer, e, "w1", w13[e, :inter])
        method.load(layer, e, "w3", w13[e, inter:])
        method.load(layer, e, "w2", w2[e])
    method.process_after_loading(layer)
    x = torch.randn(11, 48)
    weights, ids = random_routing(11, 6, 2, seed=5)
    torch.testing.assert_close(layer(x, weights, ids), reference.fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_the_shared_expert_gate_is_the_same_bits_alone_and_in_a_batch() -> None:
    from stoker.layers.activation import sigmoid_per_row

    g = torch.randn(37, 1) * 4
    full = sigmoid_per_row(g)
    torch.testing.assert_close(full, torch.sigmoid(g))
    assert all(torch.equal(sigmoid_per_row(g[i : i + n]), full[i : i + n]) for n in (1, 7) for i in range(30))
