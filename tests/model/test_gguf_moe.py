"""GGUF files of the MoE families (qwen3moe, qwen2moe, Mixtral as llama with experts), written
with the `gguf` package as llama.cpp's converter lays them out (each layer's experts stacked in
one blk.N.ffn_*_exps tensor per projection: stoker/testing/gguf_checkpoint.py), compute what HF
transformers computes on the weights the file stands for: prefill logits to 1e-4 and greedy
tokens. Float experts run the float MoE method; Q8_0 / Q6_K experts the int8 one at their
blocks' own groups; Q4_0 / Q4_1 / Q4_K experts the int4 one (codes, scale and offset per 32
columns, decoded as gguf-py dequantizes them); expert types with no exact MoE method, and a layer
whose experts mix int4 and int8, are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_int4 import Int4MoEMethod
from stoker.layers.moe_quant import QuantizedMoEMethod
from stoker.models.gguf_loader import read_gguf_config
from stoker.quantization.config import QuantizationError
from stoker.testing.gguf_checkpoint import write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

PROMPTS = [[0] + list(range(7, 40)), [0, 99, 5, 17, 256, 800, 3]]
# family, GGUF architecture, config overrides, tensor types (regex over HF names, first match; else F32)
CASES = {
    # gate/up Q8_0 (groups of 32) beside down Q6_K (16): the layer's experts at groups of 16;
    # a dense layer between sparse ones
    "qwen3_moe": ("qwen3_moe", "qwen3moe",
                  dict(hidden_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                       intermediate_size=64, head_dim=32, norm_topk_prob=True, num_hidden_layers=2, mlp_only_layers=[1]),
                  {r"experts\.\d+\.down_proj": "Q6_K", r"experts": "Q8_0", r"proj\.weight": "Q8_0"}),
    # F16 experts and a shared expert (its gate F32), top-k weights not renormalised
    "qwen2_moe": ("qwen2_moe", "qwen2moe",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       num_hidden_layers=2),
                  {r"experts|shared_expert\.": "F16"}),
    # BF16 experts, q/k rows permuted in the file (llama)
    "mixtral": ("mixtral", "llama", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
                {r"experts": "BF16", r"proj\.weight": "Q8_0"}),
    # 4-bit experts on the int4 MoE method: layer 0 Q4_K gate/up beside a Q4_1 down (asymmetric,
    # groups of 32), layer 1 Q4_0 (symmetric)
    "qwen3_moe_q4": ("qwen3_moe", "qwen3moe",
                     dict(hidden_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                          head_dim=32, norm_topk_prob=True, num_hidden_layers=2),
                     {r"layers\.0\.mlp\.experts\.\d+\.down_proj": "Q4_1", r"layers\.0\.mlp\.experts": "Q4_K",
                      r"experts": "Q4_0", r"proj\.weight": "Q8_0"}),
    # Mixtral's w1/w3 Q4_K, w2 Q4_0 (q/k rows permuted in the file: the experts are not)
    "mixtral_q4": ("mixtral", "llama",
                   dict(hidden_size=256, num_local_experts=4, num_experts_per_tok=2, intermediate_size=256),
                   {r"experts\.\d+\.w2": "Q4_0", r"experts": "Q4_K", r"proj\.weight": "Q8_0"}),
}


@pytest.fixture(scope="module")
def moe_gguf(tiny_checkpoints, tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            family, arch, overrides, types = CASES[case]
            src = tiny_checkpoints(family, **overrides)
            root = tmp_path_factory.mktemp(f"gguf-{case}")
            (root / "file").mkdir()
            path = write_gguf(src, root / "file" / "model.gguf", types, arch, dequantized_dst=root / "deq")
            copy_demo_tokenizer(root / "file")
            cache[case] = (path, root / "deq")
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_moe_gguf_file_matches_hf_on_dequantized_weights(case: str, moe_gguf) -> None:
    path, deq = moe_gguf(case)
    family = CASES[case][0]
    cfg = read_gguf_config(path)
    assert cfg["model_type"] == family
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=8 << 20, device="cpu")
    moes = {n: m for n, m in llm.engine.executor.driver_runner.model.named_modules() if isinstance(m, FusedMoE)}
    if case == "qwen3_moe":
        assert cfg["mlp_only_layers"] == [1] and sorted(moes) == ["model.layers.0.mlp.experts"]
        method = moes["model.layers.0.mlp.experts"].method
        assert isinstance(method, QuantizedMoEMethod) and method.group_k13 == 16 and method.group_k2 == 16
    elif case.endswith("_q4"):
        assert moes and all(isinstance(m.method, Int4MoEMethod) for m in moes.values())
        for m in moes.values():  # the C kernel's int4 panels (moe.c) on CPU float32, groups of 32
            assert m.method.backend == "cpu" and m.method.group_k13 == 32 and m.method.group_k2 == 32
        if case == "qwen3_moe_q4":
            assert not moes["model.layers.0.mlp.experts"].method.scheme.symmetric  # Q4_K / Q4_1: offsets
            assert moes["model.layers.1.mlp.experts"].method.scheme.symmetric  # Q4_0
    else:
        assert not any(isinstance(m.method, QuantizedMoEMethod) for m in moes.values())
    hf = load_hf(deq)
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)


@pytest.mark.parametrize("case", ["qwen3_moe_q4", "mixtral_q4"])
def test_4bit_experts_handed_to_the_int4_method_dequantize_to_gguf_py_bit_for_bit(case: str, moe_gguf) -> None:
    """Each expert's codes, scales and offsets as the loader hands them to the int4 MoE method
    (layout gguf) give, through int4.dequantize (the moe.c panels' arithmetic), exactly what
    gguf.quants.dequantize gives for the file's blocks (the dequantized checkpoint)."""
    from safetensors.torch import load_file

    from stoker.models.gguf_loader import GGUFTensors
    from stoker.quantization import int4

    path, deq = moe_gguf(case)
    want = load_file(str(deq / "model.safetensors"))
    llm = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=4 << 20, device="cpu")
    f = GGUFTensors(path, llm.engine.executor.driver_runner.model)
    experts = [k for k in f.keys() if ".experts." in k and k.endswith(".weight")]
    assert len(experts) == llm.engine.executor.driver_runner.hf_config["num_hidden_layers"] * 4 * 3
    for name in experts:
        module = name.rpartition(".")[0]
        q, scale, offset = (f.get_tensor(f"{module}.{p}") for p in ("weight", "weight_scale", "weight_offset"))
        assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == offset.shape == (q.shape[0], q.shape[1] // 32)
        assert torch.equal(int4.dequantize(q, scale, offset, 32), want[name]), name


@pytest.mark.parametrize("kind", ["Q5_K", "Q5_1", "Q2_K"])
def test_expert_types_without_an_exact_moe_method_are_refused_by_name(kind: str, tiny_checkpoints, tmp_path) -> None:
    """Affine 5-bit experts (no MoE method holds int8 codes with offsets) and types with no exact
    Stoker method at all."""
    src = tiny_checkpoints("qwen3_moe", hidden_size=256, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=256,
                           head_dim=32, num_hidden_layers=1)
    path = write_gguf(src, tmp_path / "model.gguf", {r"experts\.\d+\.up_proj": kind}, "qwen3moe", with_tokenizer=False)
    with pytest.raises(QuantizationError, match=rf"blk\.0\.ffn_up_exps\.weight .*{kind}"):
        read_gguf_config(path)


@pytest.mark.parametrize("down", ["Q6_K", "Q5_0", "F32"])
def test_a_layer_whose_experts_mix_int4_and_another_representation_is_refused_by_name(down: str, tiny_checkpoints,
                                                                                         tmp_path) -> None:
    """Q4_K_M's "more bits" layers (Q4_K gate/up beside a Q6_K down; Q5_0 where rows are not
    whole super-blocks): each MoE method holds one representation for gate, up and down."""
    src = tiny_checkpoints("qwen3_moe", hidden_size=256, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=256,
                           head_dim=32, num_hidden_layers=1)
    path = write_gguf(src, tmp_path / "model.gguf", {r"experts\.\d+\.down_proj": down, r"experts": "Q4_K"}, "qwen3moe",
                      with_tokenizer=False)
    with pytest.raises(QuantizationError, match=rf"blk\.0\.ffn_down_exps\.weight \({down}\).* different representations"):
        read_gguf_config(path)


def test_stoker_serve_takes_a_moe_gguf_file_with_4bit_experts(moe_gguf) -> None:
    """`stoker serve model.gguf` on a file whose experts are Q4_K / Q4_0: it starts and serves."""
    from openai import OpenAI

    from stoker.cli import build_parser
    from stoker.server.cli import build_app
    from tests.server.conftest import serve_app

    path, _ = moe_gguf("mixtral_q4")
    args = build_parser().parse_args(["serve", str(path), "--max-model-len", "128", "--kv-cache-memory-bytes",
                                      str(8 << 20), "--log-interval", "3600", "--served-model-name", "tiny-moe-q4"])
    app, settings = build_app(args)
    assert settings.model_path == str(path)
    live = serve_app(app)
    try:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny-moe-q4", prompt="a stoker", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    finally:
        live.stop()
