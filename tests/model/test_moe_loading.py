"""Loading MoE checkpoints (per-expert names, transformers 5's stacked layout, a missing expert)
and what the engine refuses on MoE models, each refusal naming what to change."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stoker import LLM, SamplingParams

QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [0, 5, 9, 300, 41]}, {"prompt_token_ids": [0, *range(100, 130)]}]


def tokens(path: Path, **kw) -> list[list[int]]:
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=1 << 20, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors `edit(dict)` changed."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def stack_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down -> transformers 5's in-memory gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
    out = {n: t for n, t in tensors.items() if ".experts." not in n}
    prefixes = {n.split(".experts.")[0] + ".experts" for n in tensors if ".experts." in n}
    for p in prefixes:
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                           tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(num_experts)])
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(num_experts)])
    return out


def test_stacked_experts_load_as_per_expert_ones(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints("qwen3_moe", **QWEN3_MOE)
    stacked = rewrite(path, tmp_path / "stacked", lambda t: stack_experts(t, 4))
    assert tokens(stacked) == tokens(path)


def test_a_missing_expert_is_named_as_the_checkpoint_names_it(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints("mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    broken = rewrite(path, tmp_path / "broken", lambda t: {n: v for n, v in t.items() if n != name})
    with pytest.raises(ValueError, match=f"lacks weights for: {name}"):
        tokens(broken)


def test_an_expert_of_the_wrong_shape_is_named(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints("qwen3_moe", **QWEN3_MOE)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    broken = rewrite(path, tmp_path / "broken", lambda t: {**t, name: t[name][:, :10].contiguous()})
    with pytest.raises(ValueError, match=rf"shape mismatch.*\(64, 10\).*\(64, 24\).*{name}"):
        tokens(broken)


# --quantization and --enable-lora on MoE models, once refused here, are served now:
# tests/model/test_moe_quantization.py and tests/model/test_moe_lora.py (with what they still refuse).


def test_olmoe_clip_qkv_is_refused(tiny_checkpoints) -> None:
    path = tiny_checkpoints("olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32, clip_qkv=8.0)
    with pytest.raises(ValueError, match="clip_qkv 8.0 is not supported"):
        tokens(path)
