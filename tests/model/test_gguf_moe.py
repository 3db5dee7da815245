"""GGUF files of the MoE families (qwen3moe, qwen2moe, Mixtral as llama with experts), written
with the `gguf` package as llama.cpp's converter lays them out (each layer's experts stacked in
one blk.N.ffn_*_exps tensor per projection: stoker/testing/gguf_checkpoint.py), compute what HF
transformers computes on the weights the file stands for: prefill logits to 1e-4 and greedy
tokens. Float experts run the float MoE method; Q8_0 / Q6_K experts the int8 one at their
blocks' own groups; Q4_0 / Q4_1 / Q4_K experts the int4 one (codes, scale and offset per 32
columns, decoded as gguf-py dequantizes them); llama-quantize's Q4_K_M and Q5_K_M mixes
(stoker/testing/gguf_checkpoint.llama_cpp_types: Q4_K gate/up beside a Q6_K or Q5_0 down, Q5_K
gate/up) hold those layers per projection (layers/moe_mixed.py). Refused by name: types with no
exact Stoker method, float experts beside quantized ones, gate and up of different families.
"""

from __future__ import annotations

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_int4 import Int4MoEMethod
from stoker.layers.moe_mixed import MixedMoEMethod
from stoker.layers.moe_quant import QuantizedMoEMethod
from stoker.models.gguf_loader import read_gguf_config
from stoker.quantization.config import QuantizationError
from stoker.testing.gguf_checkpoint import llama_cpp_types, write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

PROMPTS = [[0] + list(range(7, 40)), [0, 99, 5, 17, 256, 800, 3]]
# K-quants everywhere (llama_cpp_types): every projection's rows whole 256-value super-blocks (4 heads x 64)
Q4KM = dict(hidden_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, head_dim=64,
            norm_topk_prob=True)
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
    # llama-quantize's Q4_K_M over 4 layers (llama_cpp_types): layers 0-1 Q4_K throughout (the int4
    # method), layers 2-3 ("more bits") Q4_K gate/up beside a Q6_K down (held per projection,
    # layers/moe_mixed.py) and a Q6_K v beside Q4_K q/k (a composite q/k/v); token_embd Q4_K, output Q6_K
    "qwen3_moe_q4_k_m": ("qwen3_moe", "qwen3moe", dict(Q4KM, num_hidden_layers=4), llama_cpp_types("Q4_K_M", 4)),
    # Q5_K_M: Q5_K (affine int8) gate/up in every layer, beside a Q5_K down (layer 0) or a Q6_K one
    # (layer 1): every layer held per projection, int8 codes with offsets
    "qwen3_moe_q5_k_m": ("qwen3_moe", "qwen3moe", dict(Q4KM, num_hidden_layers=2), llama_cpp_types("Q5_K_M", 2)),
    # Mixtral (8 experts: llama-quantize gives attn_k and attn_v Q8_0) in Q4_K_M over 2 layers, layer 1's
    # w2 Q6_K; and layer 0's w2 Q5_0, llama-quantize's fallback for a Q4_K tensor whose rows are not
    # whole super-blocks (here written so on whole ones)
    "mixtral_q4_k_m": ("mixtral", "llama",
                       dict(hidden_size=256, num_local_experts=8, num_experts_per_tok=2, intermediate_size=256),
                       {r"layers\.0\.block_sparse_moe\.experts\.\d+\.w2": "Q5_0",
                        **llama_cpp_types("Q4_K_M", 2, num_experts=8)}),
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
    elif case.endswith("_k_m"):
        _check_mixed(case, moes)
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


def test_q4_k_m_experts_held_per_projection_match_hf_on_the_torch_backend_too(moe_gguf, monkeypatch) -> None:
    """Without the C kernels (the backend GPUs take) the per-projection layers dequantize each
    routed expert's int4 gate/up and int8 down in torch: the same logits as HF's to 1e-4."""
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    path, deq = moe_gguf("qwen3_moe_q4_k_m")
    llm = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=4 << 20, device="cpu")
    moes = [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, FusedMoE)]
    mixed = [m.method for m in moes if isinstance(m.method, MixedMoEMethod)]
    assert len(mixed) == 2 and all(m.backend == "dequant" for m in mixed)
    hf = load_hf(deq)
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


def _check_mixed(case: str, moes: dict) -> None:
    """Which layers run per projection (layers/moe_mixed.py), with which codes and groups, on moe.c."""
    methods = {int(n.split(".")[2]): m.method for n, m in moes.items()}
    mixed = {i: m for i, m in methods.items() if isinstance(m, MixedMoEMethod)}
    assert all(m.backend == "cpu" for m in mixed.values())
    if case == "qwen3_moe_q4_k_m":
        assert isinstance(methods[0], Int4MoEMethod) and isinstance(methods[1], Int4MoEMethod)
        assert sorted(mixed) == [2, 3]
        assert all(m.bits == {"w13": 4, "w2": 8} and m.group == {"w13": 32, "w2": 16} for m in mixed.values())
    elif case == "qwen3_moe_q5_k_m":
        assert sorted(mixed) == [0, 1] and all(m.bits == {"w13": 8, "w2": 8} for m in mixed.values())
        assert mixed[0].group == {"w13": 32, "w2": 32} and mixed[1].group == {"w13": 32, "w2": 16}
    else:  # mixtral: w2 Q5_0 (layer 0) and Q6_K (layer 1) beside Q4_K w1/w3
        assert sorted(mixed) == [0, 1] and all(m.bits == {"w13": 4, "w2": 8} for m in mixed.values())
        assert mixed[0].group["w2"] == 32 and mixed[1].group["w2"] == 16
    for name, layer in moes.items():  # the layer's parameters are the codes themselves: 4-bit packed, int8 one a byte
        if isinstance(layer.method, MixedMoEMethod):
            for w in ("w13", "w2"):
                assert getattr(layer, w).dtype == (torch.uint8 if layer.method.bits[w] == 4 else torch.int8), name


@pytest.mark.parametrize("case", ["qwen3_moe_q4", "mixtral_q4", "qwen3_moe_q4_k_m", "qwen3_moe_q5_k_m"])
def test_experts_handed_to_the_coded_methods_dequantize_to_gguf_py_bit_for_bit(case: str, moe_gguf) -> None:
    """Each expert's codes, scales and offsets as the loader hands them to the int4 MoE method
    (layout gguf) or the per-projection one (int4 codes uint8 in [0, 15], int8 codes for the 5-,
    6- and 8-bit types, offsets 0 for the symmetric ones) give, through int4.dequantize (the
    moe.c panels' arithmetic), exactly what gguf.quants.dequantize gives for the file's blocks
    (the dequantized checkpoint)."""
    from safetensors.torch import load_file

    from stoker.models.gguf_loader import GGUFTensors
    from stoker.quantization import int4

    path, deq = moe_gguf(case)
    want = load_file(str(deq / "model.safetensors"))
    llm = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=4 << 20, device="cpu")
    f = GGUFTensors(path, llm.engine.executor.driver_runner.model)
    experts = [k for k in f.keys() if ".experts." in k and k.endswith(".weight")]
    assert len(experts) == llm.engine.executor.driver_runner.hf_config["num_hidden_layers"] * 4 * 3
    widths = set()
    for name in experts:
        module = name.rpartition(".")[0]
        q, scale, offset = (f.get_tensor(f"{module}.{p}") for p in ("weight", "weight_scale", "weight_offset"))
        group = q.shape[1] // scale.shape[1]
        if q.dtype == torch.uint8:
            assert int(q.max()) <= 15 and group == 32
        else:
            assert q.dtype == torch.int8 and group in (16, 32)
        widths.add(q.dtype)
        assert scale.shape == offset.shape
        assert torch.equal(int4.dequantize(q, scale, offset, group), want[name]), name
    assert widths == ({torch.uint8} if case.endswith("_q4") else {torch.int8} if "q5" in case else {torch.uint8, torch.int8})


@pytest.mark.parametrize("kind", ["Q2_K", "IQ4_XS"])
def test_expert_types_without_an_exact_stoker_method_are_refused_by_name(kind: str, tiny_checkpoints, tmp_path) -> None:
    """Types with no exact Stoker method at all (Q2_K_M / Q3_K / IQ files), in every expert."""
    src = tiny_checkpoints("qwen3_moe", hidden_size=256, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=256,
                           head_dim=32, num_hidden_layers=1)
    path = write_gguf(src, tmp_path / "model.gguf", {r"experts\.\d+\.up_proj": kind, r"experts": "Q4_K"}, "qwen3moe",
                      with_tokenizer=False)
    with pytest.raises(QuantizationError, match=rf"blk\.0\.ffn_up_exps\.weight is {kind}, which has no exact"):
        read_gguf_config(path)


@pytest.mark.parametrize("types, refusal", [
    # a float down beside quantized gate/up: the MoE methods hold a layer all float or all quantized
    ({r"experts\.\d+\.down_proj": "F32", r"experts": "Q4_K"}, r"ffn_down_exps\.weight \(F32\).* float beside quantized"),
    # gate and up in different families: one GEMM in one representation (llama-quantize types them alike)
    ({r"experts\.\d+\.up_proj": "Q6_K", r"experts": "Q4_K"}, r"ffn_up_exps\.weight \(Q6_K\).* gate and up are in "
                                                               r"different representations \(int4 and int8\)"),
], ids=["float-down-beside-q4_k", "q4_k-gate-beside-q6_k-up"])
def test_a_layer_whose_experts_mix_what_no_moe_method_holds_is_refused_by_name(types: dict, refusal: str,
                                                                                  tiny_checkpoints, tmp_path) -> None:
    """What is still refused of a layer's mixes once gate/up and down may differ (layers/moe_mixed.py)."""
    src = tiny_checkpoints("qwen3_moe", hidden_size=256, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=256,
                           head_dim=32, num_hidden_layers=1)
    path = write_gguf(src, tmp_path / "model.gguf", types, "qwen3moe", with_tokenizer=False)
    with pytest.raises(QuantizationError, match=refusal):
        read_gguf_config(path)


def test_stoker_serve_takes_a_q4_k_m_moe_gguf_file(moe_gguf) -> None:
    """`stoker serve model.gguf` on llama-quantize's Q4_K_M mix of a Qwen3-MoE (int4 experts in
    two layers, Q4_K gate/up beside Q6_K down in the other two): it starts and serves."""
    from openai import OpenAI

    from stoker.cli import build_parser
    from stoker.server.cli import build_app
    from tests.server.conftest import serve_app

    path, _ = moe_gguf("qwen3_moe_q4_k_m")
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
