"""LoRA on Mixture-of-Experts models: an attention-projection adapter gives HF transformers +
peft's PeftModel's greedy tokens and logprobs on a tiny Qwen3-MoE; an adapter with weights for
an expert, a router, or a sparse layer's MLP is refused when it is registered, naming the
module (never loaded with those weights dropped), and so is the adapter PEFT makes when asked
for the MLP projections of a Qwen3-MoE (it adapts the fused experts: target_parameters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stoker import LLM, LoRARequest, SamplingParams
from stoker.lora.adapter import LoRAError
from tests.model.helpers import load_hf, make_adapter, peft_greedy

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# layer 1 dense (mlp_only_layers), layers 0 and 2 sparse
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
                 num_hidden_layers=3, mlp_only_layers=[1])
PROMPTS = [[1, 17, 300, 42, 7, 99, 5], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [600, 2, 3]]
N = 10
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1)


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20, enable_lora=True, max_lora_rank=16, **kw)


@torch.no_grad()
def peft_logprobs(base: Path, adapter: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf(base), str(adapter)).eval()
    logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_attention_adapter_on_qwen3_moe_equals_peft(tiny_checkpoints, tmp_path: Path) -> None:
    base = tiny_checkpoints("qwen3_moe", **QWEN3_MOE)
    adapter = make_adapter(base, tmp_path / "a", ATTN, 8, seed=1)
    llm = _llm(base)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(adapter)))
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == peft_greedy(base, adapter, prompt, N)
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(peft_logprobs(base, adapter, prompt, tokens)),
                                   rtol=0, atol=1e-4)
    base_out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                              use_tqdm=False)]
    assert base_out != [o.outputs[0].token_ids for o in outs]  # the adapter changed something
    llm.engine.check_integrity()


def _with_extra(src: Path, dst: Path, extra: dict[str, torch.Tensor], targets: list[str] | None = None) -> Path:
    """A copy of adapter `src` with more lora_A / lora_B tensors (as PEFT names them)."""
    dst.mkdir()
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({**tensors, **extra}, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    if targets is not None:
        cfg["target_modules"] = targets
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_expert_and_router_adapters_are_refused_by_name(tiny_checkpoints, tmp_path: Path) -> None:
    base = tiny_checkpoints("qwen3_moe", **QWEN3_MOE)
    ok = make_adapter(base, tmp_path / "ok", ATTN, 8, seed=2)
    llm = _llm(base)
    r, h, i = 8, 64, QWEN3_MOE["moe_intermediate_size"]
    prefix = "base_model.model.model.layers.0.mlp"

    def pair(module: str, shape_in: int, shape_out: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{module}.lora_A.weight": torch.randn(r, shape_in),
                f"{prefix}.{module}.lora_B.weight": torch.randn(shape_out, r)}

    expert = _with_extra(ok, tmp_path / "expert", pair("experts.3.gate_proj", h, i), ATTN + ["gate_proj"])
    with pytest.raises(LoRAError, match=r"Mixture-of-Experts module 'layers\.0\.mlp\.experts\.3\.gate_proj'"):
        llm.engine.load_lora("expert", str(expert))
    router = _with_extra(ok, tmp_path / "router", pair("gate", h, QWEN3_MOE["num_experts"]))
    with pytest.raises(LoRAError, match=r"Mixture-of-Experts module 'layers\.0\.mlp\.gate'"):
        llm.engine.load_lora("router", str(router))
    # a sparse layer's MLP named as a dense one's would be: layer 0 has no gate_proj to adapt
    inter = _dense_intermediate_size(base)
    sparse_mlp = _with_extra(ok, tmp_path / "sparse-mlp", pair("gate_proj", h, inter), ATTN + ["gate_proj"])
    with pytest.raises(LoRAError, match=r"layer 0 gate_proj \(model\.layers\.0\.mlp\.gate_proj\): layer 0's MLP is a "
                                        r"Mixture-of-Experts block"):
        llm.engine.load_lora("sparse-mlp", str(sparse_mlp))
    with pytest.raises(LoRAError, match="target_modules \\['gate'\\] are not supported"):
        llm.engine.load_lora("gate", str(_with_extra(ok, tmp_path / "gate-target", {}, ATTN + ["gate"])))
    peft_mlp = make_adapter(base, tmp_path / "peft-mlp", ATTN + MLP, 8, seed=3)
    with pytest.raises(LoRAError, match=r"target_parameters \['down_proj', 'gate_up_proj'\] \(mlp\.experts\)"):
        llm.engine.load_lora("peft-mlp", str(peft_mlp))
    assert llm.engine.lora.names() == []  # nothing half-registered
    llm.engine.load_lora("ok", str(ok))  # an attention adapter still loads
    assert llm.engine.lora.names() == ["ok"]


def _dense_intermediate_size(base: Path) -> int:
    return json.loads((base / "config.json").read_text())["intermediate_size"]
