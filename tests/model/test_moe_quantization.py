"""Quantized experts (layers/moe_quant.py) against the float model they come from.

Online (`--quantization fp8|int8` on a float MoE checkpoint), on each MoE family: teacher-forced
over 256 positions, mean KL(float || quantized) and top-1 agreement of the float model with
the quantized experts put in, within the bounds the dense quantization tests use
(tests/model/test_online_quantization.py), and of the whole quantized model within bounds
measured here (WHOLE_MODEL_BOUNDS); a planted fault (one expert's scale doubled in every sparse
layer) well outside them; greedy tokens stable; the engine whole afterwards (the conftest's
check_integrity()).

Pre-quantized: a checkpoint written by the test in compressed-tensors layout (FP8 and INT8 per
channel, FP8 with static input scales, INT8 packed per group), per-tensor FP8, and 128 x 128 block FP8 (`weight_scale_inv` per block, as
Qwen3-30B-A3B-FP8 ships) loads, every expert quantized with its own scales, and computes what
the float model made of the same dequantized weights computes (float32 tolerance on CPU).
"""

from __future__ import annotations


import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_quant import QuantizedMoEMethod
from stoker.layers.moe_router import RouterLinear
from stoker.quantization.config import QuantizationError, online_config
from stoker.testing.quantized_checkpoint import quantize_checkpoint
from tests.model.helpers import engine_logits, kl_and_top1, teacher_forced_positions
from tests.model.test_online_quantization import BOUNDS

MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
                                    num_hidden_layers=3, mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(MOE, num_local_experts=8, intermediate_size=32)),
    "qwen2_moe": ("qwen2_moe", dict(MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_hidden_layers=3, mlp_only_layers=[0])),
    "olmoe": ("olmoe", dict(MOE, num_experts=8, intermediate_size=32)),
    # clamped SwiGLU and expert biases (the biases stay float)
    "gpt_oss": ("gpt_oss", dict(MOE, num_local_experts=8, intermediate_size=32, head_dim=16, sliding_window=24,
                                num_hidden_layers=3)),
}
PROMPTS = [[0] + list(range(7, 70)), [0, 99, 5, 17, 256, 800, 3]]


@pytest.fixture(scope="module")
def positions() -> list[int]:
    return teacher_forced_positions()


def _llm(path, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, device="cpu", max_model_len=512, **kw)


def _moes(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, FusedMoE)]


def _greedy(llm: LLM, n: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


# The whole quantized model (attention, dense MLP layers and shared experts quantized too) on
# these tiny MoE configurations: int8 KL 2.7e-4 to 1.1e-3, top-1 0.96 to 0.99; fp8 KL 2.3e-3 to
# 8.1e-3, top-1 0.89 to 0.92. Most of it is the attention projections' (quantizing only the
# experts of a ct-int8 checkpoint: 2e-5 to 1.7e-4), so these are about 3x the worst measured.
WHOLE_MODEL_BOUNDS = {"int8": (3e-3, 0.93), "fp8": (2.5e-2, 0.83)}
# gpt-oss whole-model fp8 (its attention, with biases and sinks, quantized too): KL 6.4e-3, top-1
# 0.824 measured; its experts alone stay within the dense bounds like every family's.
WHOLE_MODEL_TOP1 = {("gpt_oss", "fp8"): 0.78}


def _with_experts_of(float_llm: LLM, quantized_llm: LLM) -> LLM:
    """The float model with the quantized model's FusedMoE layers put in its blocks: what the
    experts' quantization alone changes (the router stays the float model's, as it is float)."""
    ours = dict(float_llm.engine.executor.driver_runner.model.named_modules())
    for name, module in quantized_llm.engine.executor.driver_runner.model.named_modules():
        if isinstance(module, FusedMoE):
            parent, _, leaf = name.rpartition(".")
            setattr(ours[parent], leaf, module)
    return float_llm


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_online_quantized_experts_stay_close_to_the_float_model(family, quantization, tiny_checkpoints, positions) -> None:
    arch, overrides = FAMILIES[family]
    path = tiny_checkpoints(arch, **overrides)
    ref = engine_logits(_llm(path), positions)
    llm = _llm(path, quantization=quantization)
    moes = _moes(llm)
    assert moes and all(isinstance(m.method, QuantizedMoEMethod) and m.method.kind == quantization for m in moes)
    routers = [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, RouterLinear)]
    assert routers and all(r.weight.dtype == torch.float32 and r.method.kind == "float" for r in routers)
    # the experts alone, within the dense projections' bounds
    kl, top1 = kl_and_top1(ref, engine_logits(_with_experts_of(_llm(path), llm), positions))
    max_kl, min_top1 = BOUNDS[quantization, "auto"]
    print(f"{family} {quantization} experts only: KL {kl:.2e} top-1 {top1:.3f}")
    assert 0 < kl < max_kl and top1 >= min_top1, f"experts only: KL {kl:.2e}, top-1 {top1:.3f}"
    # the whole quantized model
    kl, top1 = kl_and_top1(ref, engine_logits(llm, positions))
    max_kl, min_top1 = WHOLE_MODEL_BOUNDS[quantization]
    min_top1 = WHOLE_MODEL_TOP1.get((family, quantization), min_top1)
    print(f"{family} {quantization} whole model: KL {kl:.2e} top-1 {top1:.3f}")
    assert 0 < kl < max_kl and top1 >= min_top1, f"whole model: KL {kl:.2e}, top-1 {top1:.3f}"
    # greedy decoding is a pure function of the weights: the same tokens twice, and alone as in a batch
    first = _greedy(llm)
    assert _greedy(llm) == first
    alone = [_greedy_one(llm, p) for p in PROMPTS]
    assert alone == first


def _greedy_one(llm: LLM, prompt: list[int], n: int = 24) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_one_experts_scale_doubled_is_caught(family, tiny_checkpoints, positions) -> None:
    """The bounds are tight enough to see one expert's down-projection scale off by 2x."""
    arch, overrides = FAMILIES[family]
    path = tiny_checkpoints(arch, **overrides)
    ref = engine_logits(_llm(path), positions)
    llm = _llm(path, quantization="int8")
    for moe in _moes(llm):
        moe.w2_scale.data[0] *= 2  # expert 0 of each sparse layer: about k / E = 1/4 of the tokens
    kl, top1 = kl_and_top1(ref, engine_logits(_with_experts_of(_llm(path), llm), positions))
    print(f"{family} int8 experts only, expert 0's w2 scale x2: KL {kl:.2e} top-1 {top1:.3f}")
    assert kl > BOUNDS["int8", "auto"][0] * 10


# ---------------------------------------------------------------- pre-quantized checkpoints
WIDE_QWEN3 = dict(FAMILIES["qwen3_moe"][1], hidden_size=192, moe_intermediate_size=160, intermediate_size=320,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=32)
CHECKPOINTS = [
    ("qwen3_moe", "ct-fp8-channel"),
    ("qwen3_moe", "ct-int8-channel"),
    ("qwen3_moe", "ct-int8-pack-group"),
    ("qwen3_moe", "fp8-block"),
    ("qwen3_moe", "ct-fp8-channel-static"),  # a static input_scale per expert: read, checked, run weight-only
    ("mixtral", "ct-fp8-channel"),
    ("qwen2_moe", "fp8-block"),
    ("olmoe", "fp8-tensor"),
]


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """(family, format) -> (quantized checkpoint, float checkpoint of the same dequantized weights)."""
    cache = {}

    def get(family: str, fmt: str):
        if (family, fmt) not in cache:
            arch, overrides = FAMILIES[family]
            if fmt == "fp8-block":  # projections wider than one 128 x 128 block, partial blocks included
                overrides = WIDE_QWEN3 if family == "qwen3_moe" else dict(overrides, hidden_size=192,
                                                                          moe_intermediate_size=160, num_attention_heads=6,
                                                                          num_key_value_heads=2)
            src = tiny_checkpoints(arch, **overrides)
            root = tmp_path_factory.mktemp(f"{family}-{fmt}")
            ignore = ("lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$")
            q = quantize_checkpoint(src, root / "q", fmt, dequantized_dst=root / "deq", ignore=ignore)
            cache[family, fmt] = (q, root / "deq")
        return cache[family, fmt]

    return get


@pytest.mark.parametrize("family, fmt", CHECKPOINTS)
def test_prequantized_moe_checkpoint_matches_its_dequantized_float_model(family, fmt, quantized) -> None:
    qpath, deq = quantized(family, fmt)
    llm = _llm(qpath)
    expected = "int8" if "int8" in fmt else "fp8"
    moes = _moes(llm)
    assert moes and all(isinstance(m.method, QuantizedMoEMethod) and m.method.kind == expected for m in moes)
    ref_llm = _llm(deq)
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), engine_logits(ref_llm, ids), rtol=1e-4, atol=2e-4)
    assert _greedy(llm) == _greedy(ref_llm)


# ---------------------------------------------------------------- what is still refused, by name
def test_a_missing_expert_scale_is_named(quantized, tmp_path) -> None:
    from tests.model.test_moe_loading import rewrite

    qpath, _ = quantized("qwen3_moe", "ct-fp8-channel")
    name = "model.layers.2.mlp.experts.5.down_proj.weight_scale"
    broken = rewrite(qpath, tmp_path / "broken", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=f"lacks weights for: {name}"):
        _llm(broken)


def test_an_ignore_list_that_splits_a_layers_experts_is_refused(tiny_checkpoints, tmp_path) -> None:
    arch, overrides = FAMILIES["qwen3_moe"]
    src = tiny_checkpoints(arch, **overrides)
    ignore = ("lm_head", "re:.*mlp\\.gate$", "re:.*experts\\.3\\..*")
    q = quantize_checkpoint(src, tmp_path / "q", "ct-int8-channel", ignore=ignore)
    with pytest.raises(QuantizationError, match=r"ignores some experts of model\.layers\.0\.mlp\.experts .*experts\.3\.gate_proj"):
        _llm(q)


def test_ignored_experts_load_as_floats(tiny_checkpoints, tmp_path) -> None:
    arch, overrides = FAMILIES["qwen3_moe"]
    src = tiny_checkpoints(arch, **overrides)
    q = quantize_checkpoint(src, tmp_path / "q", "ct-fp8-channel", ignore=("lm_head", "re:.*mlp\\.gate$", "re:.*experts.*"))
    moes = _moes(_llm(q))
    assert moes and all(not isinstance(m.method, QuantizedMoEMethod) and m.w13.dtype == torch.float32 for m in moes)


def test_prequantized_experts_under_tensor_parallelism_are_refused(tiny_checkpoints) -> None:
    """Chosen at build: per-block and per-group scales split between ranks are not built yet."""
    from torch import nn

    from stoker.distributed.partition import Partition
    from stoker.models.method_chooser import LinearMethodChooser
    from stoker.quantization.config import parse_checkpoint_config

    quant = parse_checkpoint_config({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    chooser = LinearMethodChooser(quant, torch.device("cpu"), torch.float32, nn.Module())
    layer = FusedMoE(8, 64, 32, split=Partition(2, 0), tp=object())  # a group is only kept for its all-reduce
    with pytest.raises(QuantizationError, match=r"pre-quantized Mixture-of-Experts experts \(model\.layers\.0\.mlp\.experts\) "
                                                r"under tensor parallelism are not supported"):
        chooser.moe("model.layers.0.mlp.experts", layer)
    online = LinearMethodChooser(online_config("int8"), torch.device("cpu"), torch.float32, nn.Module())
    assert isinstance(online.moe("model.layers.0.mlp.experts", layer), QuantizedMoEMethod)



# ---------------------------------------------------------------- the layer, each backend
@pytest.mark.parametrize("backend, fuse, inter", [("cpu_q8", True, 32), ("cpu_q8", False, 20), ("dequant", False, 20)],
                         ids=["cpu_q8-fused-silu", "cpu_q8", "dequant"])
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_each_backend_equals_the_expert_loop_on_dequantized_weights(backend, fuse, inter, dtype) -> None:
    """Every backend the chooser can pick, against reference.fused_moe on the weights the
    quantized ones stand for (odd I: panels padded, SiLU not fused; the torch path CUDA takes)."""
    from stoker.kernels import reference
    from stoker.kernels.cpu import build as cpu_kernels
    from stoker.layers.moe_router import softmax_topk
    from stoker.quantization import formats

    if backend == "cpu_q8" and not cpu_kernels.available():
        pytest.skip("the C kernels are not built")
    e, h, k, t = 6, 48, 2, 11
    torch.manual_seed(0)
    w13, w2 = torch.randn(e, 2 * inter, h) * 0.2, torch.randn(e, h, inter) * 0.2
    scheme = online_config(dtype).weights
    layer = FusedMoE(e, h, inter)
    layer.attach(QuantizedMoEMethod(scheme, True, backend, fuse))
    for x in range(e):
        layer.method.load(layer, x, "w1", w13[x, :inter])
        layer.method.load(layer, x, "w3", w13[x, inter:])
        layer.method.load(layer, x, "w2", w2[x])
    deq13 = torch.stack([formats.dequantize(q, s, h) for q, s in zip(layer.w13.data, layer.w13_scale.data)])
    deq2 = torch.stack([formats.dequantize(q, s, inter) for q, s in zip(layer.w2.data, layer.w2_scale.data)])
    assert 0 < (deq2 - w2).abs().max() < 0.1 * w2.abs().max()  # quantized, not copied
    layer.method.process_after_loading(layer)
    assert layer.method.fuse_silu_and_mul == fuse
    x = torch.randn(t, h)
    weights, ids = softmax_topk(torch.randn(t, e), k, renormalize=True)
    torch.testing.assert_close(layer(x, weights, ids), reference.fused_moe(x, deq13, deq2, weights, ids), rtol=1e-5, atol=1e-5)
