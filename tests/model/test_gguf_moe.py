"""GGUF files of the MoE families (qwen3moe, qwen2moe, Mixtral as llama with experts), written
with the `gguf` package as llama.cpp's converter lays them out (each layer's experts stacked in
one blk.N.ffn_*_exps tensor per projection: stoker/testing/gguf_checkpoint.py), compute what HF
transformers computes on the weights the file stands for: prefill logits to 1e-4 and greedy
tokens. Float experts run the float MoE method; Q8_0 / Q6_K experts the int8 one at their
blocks' own groups; expert types with no exact MoE method are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.moe import FusedMoE
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
    else:
        assert not any(isinstance(m.method, QuantizedMoEMethod) for m in moes.values())
    hf = load_hf(deq)
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "Q5_K", "Q2_K"])
def test_expert_types_without_an_exact_moe_method_are_refused_by_name(kind: str, tiny_checkpoints, tmp_path) -> None:
    src = tiny_checkpoints("qwen3_moe", hidden_size=256, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=256,
                           head_dim=32, num_hidden_layers=1)
    path = write_gguf(src, tmp_path / "model.gguf", {r"experts\.\d+\.up_proj": kind}, "qwen3moe", with_tokenizer=False)
    with pytest.raises(QuantizationError, match=rf"blk\.0\.ffn_up_exps\.weight .*{kind}"):
        read_gguf_config(path)
