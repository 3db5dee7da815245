"""The Triton fused-MoE kernel (kernels/fused_moe.py, interpreted here; compiled in tests/gpu)
against its twin (reference.fused_moe_grouped, which rounds where the kernel rounds) and against
the per-expert loop the other methods run (layers/moe.expert_by_expert), float and 8-bit.

Tolerances, as ||out - ref|| / ||ref||: float32 1e-6 against both (the same products, sums
in other orders). bfloat16 against the twin 2e-3: the same roundings, so only a float32 sum in
another order can move a bf16 intermediate to its neighbour (one rounding is ~4e-3 relative;
the interpreter gives the twin's bits here, the GPU's tensor-core sums may not). bfloat16
against the per-expert loop 1.5e-2: the loop rounds each GEMM output to bf16 before the
activation and adds the k choices in bf16 (measured up to 7e-3 on these shapes).
"""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import reference
from stoker.layers.moe import FusedMoE, TorchMoEMethod, expert_by_expert
from stoker.layers.moe_router import softmax_topk
from stoker.quantization import formats
from stoker.quantization.config import QuantConfig, WeightScheme

pytest.importorskip("triton")
from stoker.kernels.fused_moe import fused_moe, moe_align_block_size  # noqa: E402

TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-3}
LOOP_TOL = {torch.float32: 1e-6, torch.bfloat16: 1.5e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13, w2


def routing(num_tokens: int, num_experts: int, k: int, idle: int | None = None, seed: int = 0):
    """softmax top-k routing; `idle`: an expert no token picks (its logit pushed to -inf)."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    if idle is not None:
        logits[:, idle] = float("-inf")
    return softmax_topk(logits, k, renormalize=True)


def loop(x, w13, w2, weights, ids, act=reference.silu_and_mul) -> torch.Tensor:
    """layers/moe.expert_by_expert over the float experts, as TorchMoEMethod runs them."""
    return expert_by_expert(x, weights, ids, w13.shape[0], lambda e, rows: act(rows @ w13[e].t()) @ w2[e].t())


# (E, k, H, I, T): E = 1; k = E; odd H, I and T; one token; BLOCK_M 64 (more pairs than 4 per expert)
SHAPES = [(1, 1, 32, 16, 3), (4, 4, 24, 20, 5), (4, 2, 33, 17, 7), (6, 2, 40, 24, 1), (3, 2, 48, 40, 37)]
IDS = ["E=1", "k=E", "odd-H-I-T", "one-token", "block-64"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens", SHAPES, ids=IDS)
def test_matches_the_twin_and_the_per_expert_loop(num_experts, k, hidden, inter, num_tokens, dtype) -> None:
    w13, w2 = (w.to(dtype) for w in experts(num_experts, hidden, inter))
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = routing(num_tokens, num_experts, k)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, reference.fused_moe_grouped(x, w13, w2, weights, ids)) < TOL[dtype]
    assert rel_err(out, loop(x, w13, w2, weights, ids)) < LOOP_TOL[dtype]


def test_an_expert_no_token_picks() -> None:
    w13, w2 = experts(5, 24, 16)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(6, 5, 2, idle=2)
    assert not (ids == 2).any()
    w13[2], w2[2] = float("nan"), float("nan")  # never read: its blocks do not exist
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, loop(x, w13, w2, weights, ids), rtol=0, atol=1e-5)


def test_alignment_pads_each_expert_to_whole_blocks() -> None:
    num_experts, block_m, k = 5, 4, 2
    weights, ids = routing(9, num_experts, k, idle=3, seed=4)
    sorted_ids, block_expert, num_padded = moe_align_block_size(ids, num_experts, block_m)
    num_pairs = ids.numel()
    # worst case over any routing, so the shapes depend on (T, k, E, BLOCK_M) alone
    assert sorted_ids.numel() == -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    assert block_expert.numel() * block_m == sorted_ids.numel()
    flat = ids.reshape(-1)
    counts = [int((flat == e).sum()) for e in range(num_experts)]
    assert int(num_padded) == sum(-(-c // block_m) * block_m for c in counts)
    used = sorted_ids[: int(num_padded)]
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert (sorted_ids[int(num_padded):] == num_pairs).all()  # padding past the end
    for b in range(int(num_padded) // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = block[block < num_pairs].long()
        assert len(pairs) > 0 and (flat[pairs] == int(block_expert[b])).all()  # one expert per block
        assert pairs.tolist() == sorted(pairs.tolist())  # token order within an expert
    assert (block_expert[int(num_padded) // block_m:] == num_experts).all()


@pytest.mark.parametrize("hidden_act, activation", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"), ("relu", "relu")])
def test_other_gates(hidden_act: str, activation: str) -> None:
    from stoker.layers.activation import get_gated_activation

    w13, w2 = experts(3, 24, 16)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(5, 3, 2)
    out = fused_moe(x, w13, w2, weights, ids, activation)
    torch.testing.assert_close(out, reference.fused_moe_grouped(x, w13, w2, weights, ids, activation), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, loop(x, w13, w2, weights, ids, get_gated_activation(hidden_act)), rtol=0, atol=1e-5)


def quantized_experts(w: torch.Tensor, dtype: str, block: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(E, N, K) float -> qweight (E, N, K), scale (E, N, G) as layers/moe_quant.py holds them:
    per channel, or 128 x 128-style blocks brought to rows by formats.scale_rows."""
    n, k = w.shape[1:]
    if block is None:
        qs = [formats.quantize_rows(we, dtype) for we in w]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs]), k
    qweights, scales = [], []
    for we in w:
        bs = we.abs().reshape(-1, 1).new_zeros(-(-n // block), -(-k // block))
        for i in range(bs.shape[0]):
            for j in range(bs.shape[1]):
                tile = we[i * block:(i + 1) * block, j * block:(j + 1) * block]
                bs[i, j] = tile.abs().max() / (formats.FP8_MAX if dtype == "fp8" else formats.INT8_MAX)
        rows, group_k = formats.scale_rows(bs, "block", n, k, None, (block, block))
        qweights.append(formats.quantize_with(we, formats.expand_groups(rows, group_k, k), dtype))
        scales.append(rows)
    return torch.stack(qweights), torch.stack(scales), block


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("block", [None, 64], ids=["per-channel", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_8bit_experts(qdtype: str, block: int | None, dtype: torch.dtype) -> None:
    # H 144 and I 136 at block 64: three K groups each, the last partial (the blocks of 128 ship
    # as 128; 64 keeps the interpreted shapes small with the same tiling: BLOCK_K divides the group)
    num_experts, hidden, inter, num_tokens, k = 3, 144, 136, 5, 2
    w13, w2 = experts(num_experts, hidden, inter)
    q13, s13, g13 = quantized_experts(w13, qdtype, block)
    q2, s2, g2 = quantized_experts(w2, qdtype, block)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = routing(num_tokens, num_experts, k)
    out = fused_moe(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2)
    twin = reference.fused_moe_grouped(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2)
    assert rel_err(out, twin) < TOL[dtype]
    # the per-expert loop of the dequant backend (reference.w8_linear per expert)
    per_expert = expert_by_expert(x, weights, ids, num_experts, lambda e, rows: reference.w8_linear(
        reference.silu_and_mul(reference.w8_linear(rows, q13[e], s13[e], g13)), q2[e], s2[e], g2))
    assert rel_err(out, per_expert) < LOOP_TOL[dtype]


def layer_with(method, num_experts=4, hidden=24, inter=16, w13=None, w2=None) -> FusedMoE:
    layer = FusedMoE(num_experts, hidden, inter)
    layer.attach(method)
    for e in range(num_experts):
        method.load(layer, e, "w1", w13[e, :inter])
        method.load(layer, e, "w3", w13[e, inter:])
        method.load(layer, e, "w2", w2[e])
    method.process_after_loading(layer)
    return layer


def test_the_triton_methods_match_the_torch_ones() -> None:
    from stoker.layers.moe_quant import QuantizedMoEMethod
    from stoker.layers.moe_triton import TritonMoEMethod

    w13, w2 = experts(4, 24, 16)
    x = torch.randn(7, 24, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(7, 4, 2)
    triton_float = layer_with(TritonMoEMethod(), w13=w13, w2=w2)
    assert triton_float.method.graph_capturable
    torch.testing.assert_close(triton_float(x, weights, ids), layer_with(TorchMoEMethod(), w13=w13, w2=w2)(x, weights, ids),
                               rtol=0, atol=1e-5)
    for qdtype in ("int8", "fp8"):
        scheme = WeightScheme(qdtype, "channel")
        fast = layer_with(QuantizedMoEMethod(scheme, True, "triton"), w13=w13, w2=w2)
        slow = layer_with(QuantizedMoEMethod(scheme, True, "dequant"), w13=w13, w2=w2)
        assert fast.method.graph_capturable and not slow.method.graph_capturable
        torch.testing.assert_close(fast(x, weights, ids), slow(x, weights, ids), rtol=0, atol=1e-5)


def test_the_chooser_picks_triton_on_cuda_only() -> None:
    """Decided from the device type at build (no GPU needed to ask); CPU keeps its methods."""
    from stoker.models.method_chooser import LinearMethodChooser

    layer = FusedMoE(4, 32, 16)
    model = torch.nn.Module()
    for dtype in (torch.float32, torch.bfloat16):
        cuda = LinearMethodChooser(None, torch.device("cuda"), dtype, model).moe("mlp.experts", layer)
        assert type(cuda).__name__ == "TritonMoEMethod"
        cpu = LinearMethodChooser(None, torch.device("cpu"), dtype, model).moe("mlp.experts", layer)
        assert type(cpu).__name__ in ("PackedCpuMoEMethod", "TorchMoEMethod")
    for scheme, backend in ((WeightScheme("fp8", "block", block=(128, 128)), "triton"),
                            (WeightScheme("int8", "group", group_size=8), "dequant")):  # 8 columns do not tile
        quant = QuantConfig(method=scheme.dtype, source="compressed-tensors", weights=scheme)
        assert LinearMethodChooser(quant, torch.device("cuda"), torch.bfloat16, model).moe("mlp.experts", layer).backend == backend
        assert LinearMethodChooser(quant, torch.device("cpu"), torch.bfloat16, model).moe("mlp.experts", layer).backend == "dequant"


def test_rejects_bad_arguments() -> None:
    w13, w2 = experts(2, 16, 8)
    x = torch.randn(3, 16)
    weights, ids = routing(3, 2, 1)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="float experts run in the model dtype"):
        fused_moe(x.bfloat16(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="scales and group_k are needed"):
        fused_moe(x, w13.to(torch.int8), w2.to(torch.int8), weights, ids)
    with pytest.raises(ValueError, match="topk_weights must be"):
        fused_moe(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, w2, weights, ids, "tanh")
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)


def test_expert_parallel_ranks_on_the_triton_method_sum_to_the_whole_layer() -> None:
    """Under --enable-expert-parallel each rank's method gets its pairs one per row (k = 1,
    layers/moe_expert_parallel.py): the kernel takes that shape, and the ranks' partial outputs
    add up to the whole layer's."""
    from stoker.distributed.expert_partition import ExpertPartition
    from stoker.layers.moe_triton import TritonMoEMethod

    class Partials:  # a stand-in group that keeps each rank's partial output
        world_size = 2

        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(x.clone())
            return x

    w13, w2 = experts(5, 24, 16)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(6, 5, 2)
    group = Partials()
    for r in range(2):
        held = ExpertPartition(5, 2, r)
        layer = FusedMoE(5, 24, 16, tp=group, experts=held)  # type: ignore[arg-type]
        layer.attach(TritonMoEMethod())
        with torch.no_grad():
            layer.w13.copy_(w13[held.start:held.stop])
            layer.w2.copy_(w2[held.start:held.stop])
        layer(x, weights, ids)
    assert rel_err(group.seen[0] + group.seen[1], loop(x, w13, w2, weights, ids)) < 1e-6


# ---- the small-batch path (GEMV-style kernels, T <= SMALL_BATCH_TOKENS) ----------------------------


@pytest.fixture
def poisoned(monkeypatch):
    """Every float buffer the launcher allocates starts as NaN, so a kernel that leaves one
    element unwritten (an output column, an empty K split's partial) shows in the result."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(empty_like(*a, **kw)))


@pytest.fixture
def few_sms(monkeypatch):
    """The small-batch tiles aim at 8 programs per SM of the GPU (132 under the interpreter): for
    the tests' tiny shapes that is thousands of interpreted programs. 8 SMs keep the same code
    paths (tiles narrower than the shapes, split K) at a fraction of the time."""
    from stoker.kernels import fused_moe as module

    monkeypatch.setattr(module, "num_sms", lambda index: 8)


def test_small_batch_is_chosen_from_shapes_only() -> None:
    from stoker.kernels import fused_moe as module

    calls = []
    real = module._fused_moe_small
    w13, w2 = experts(4, 24, 16)
    for num_tokens, k in ((1, 2), (1, 4), (2, 2), (8, 2)):
        x = torch.randn(num_tokens, 24)
        weights, ids = routing(num_tokens, 4, k)
        module._fused_moe_small = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # type: ignore[assignment]
        try:
            n = len(calls)
            fused_moe(x, w13, w2, weights, ids)
            assert (len(calls) > n) == (num_tokens <= module.SMALL_BATCH_TOKENS)
        finally:
            module._fused_moe_small = real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_experts, k, hidden, inter, num_tokens", SHAPES[:4], ids=IDS[:4])  # not 37 tokens: decode's path
def test_small_batch_matches_the_twin(num_experts, k, hidden, inter, num_tokens, dtype, poisoned, few_sms) -> None:
    w13, w2 = (w.to(dtype) for w in experts(num_experts, hidden, inter))
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = routing(num_tokens, num_experts, k)
    out = fused_moe(x, w13, w2, weights, ids, small_batch=True)
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    assert rel_err(out, reference.fused_moe_grouped(x, w13, w2, weights, ids)) < TOL[dtype]
    assert rel_err(out, loop(x, w13, w2, weights, ids)) < LOOP_TOL[dtype]


@pytest.mark.parametrize("split", [1, 4])
def test_small_batch_split_k_and_narrow_tiles(split: int, monkeypatch, poisoned) -> None:
    """Tiles narrower than the shapes (several N and K tiles, a partial last one) and the down
    GEMM's K split in 4 with the last split empty (I 40 in chunks of 16): its partial must be 0."""
    from stoker.kernels import fused_moe as module

    tiles = {"BLOCK_N13": 8, "BLOCK_K13": 16, "BLOCK_N2": 16, "BLOCK_K2": 16, "SPLIT_K": split, "num_warps": 4}
    monkeypatch.setattr(module, "small_tile_config", lambda *a, **kw: dict(tiles))
    w13, w2 = (w.bfloat16() for w in experts(5, 40, 40))
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)).bfloat16()
    weights, ids = routing(3, 5, 3)
    out = fused_moe(x, w13, w2, weights, ids, small_batch=True)
    assert not out.isnan().any()
    assert rel_err(out, reference.fused_moe_grouped(x, w13, w2, weights, ids)) < TOL[torch.bfloat16]


def test_small_batch_tiles_cover_the_sms() -> None:
    """Mixtral-shaped decode (H 4096, I 14336, 2 pairs): at least 8 programs per SM of 132 in both
    GEMMs, 16-byte weight vectors along K, and the 8-bit K tile dividing 128-column scale groups."""
    from stoker.kernels.fused_moe import small_tile_config

    for weight_bytes, group in ((2, None), (1, None), (1, 128)):
        gk13, gk2 = (group, group) if group else (4096 + 64, 14336 + 64)
        t = small_tile_config(2, weight_bytes, gk13, gk2, 4096, 14336, 132)
        assert t["BLOCK_K13"] * weight_bytes == 512 // (4 if group else 1) and (not group or group % t["BLOCK_K2"] == 0)
        assert 2 * -(-14336 // t["BLOCK_N13"]) >= 8 * 132
        assert 2 * -(-4096 // t["BLOCK_N2"]) * t["SPLIT_K"] >= 8 * 132


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("block", [None, 64], ids=["per-channel", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_small_batch_8bit_experts(qdtype: str, block: int | None, dtype: torch.dtype, poisoned, few_sms) -> None:
    num_experts, hidden, inter, num_tokens, k = 3, 144, 136, 2, 2
    w13, w2 = experts(num_experts, hidden, inter)
    q13, s13, g13 = quantized_experts(w13, qdtype, block)
    q2, s2, g2 = quantized_experts(w2, qdtype, block)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = routing(num_tokens, num_experts, k)
    out = fused_moe(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2, small_batch=True)
    assert not out.isnan().any()
    twin = reference.fused_moe_grouped(x, q13, q2, weights, ids, "silu", s13, s2, g13, g2)
    assert rel_err(out, twin) < TOL[dtype]


def test_small_batch_other_gates_and_an_idle_expert() -> None:
    w13, w2 = experts(5, 24, 16)
    w13[2], w2[2] = float("nan"), float("nan")  # never read: no pair routes to it
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(3, 5, 2, idle=2)
    for activation in ACTIVATIONS_UNDER_TEST:
        out = fused_moe(x, w13, w2, weights, ids, activation, small_batch=True)
        torch.testing.assert_close(out, reference.fused_moe_grouped(x, w13, w2, weights, ids, activation), rtol=0, atol=1e-5)


ACTIVATIONS_UNDER_TEST = ("silu", "gelu", "gelu_tanh", "relu")


def test_small_batch_takes_int32_expert_ids() -> None:
    w13, w2 = experts(4, 24, 16)
    x = torch.randn(2, 24, generator=torch.Generator().manual_seed(1))
    weights, ids = routing(2, 4, 2)
    out = fused_moe(x, w13, w2, weights, ids.int(), small_batch=True)
    torch.testing.assert_close(out, reference.fused_moe_grouped(x, w13, w2, weights, ids), rtol=0, atol=1e-5)
