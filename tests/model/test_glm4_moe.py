"""GLM-4.5 beyond the shared MoE family tests (tests/model/test_moe_families.py): the router's
correction bias is loaded and steers, the Hub's multi-token-prediction layer is skipped, a
Hub-style config (rope fields at the top level, or none) rotates the part transformers does,
and a missing correction bias is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stoker import LLM, SamplingParams
from tests.model.helpers import engine_logits, hf_logits, load_hf

GLM = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
           routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, head_dim=16,
           num_hidden_layers=3)
PROMPT = [0, *range(100, 160)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(path: Path) -> LLM:
    return LLM(str(path), max_model_len=256, kv_cache_memory_bytes=4 << 20)


def rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(str(src / "model.safetensors"))
        save_file(edit_tensors(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(edit_config(cfg)))
    return dst


def test_the_correction_bias_is_loaded_and_steers(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints("glm4_moe", **GLM)
    ckpt = load_file(str(path / "model.safetensors"))
    bias = ckpt["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0  # the tiny checkpoint's is random, not transformers' zeros
    llm = engine(path)
    gate = llm.engine.executor.driver_runner.model.model.layers[1].mlp.gate
    torch.testing.assert_close(gate.e_score_correction_bias, bias, rtol=0, atol=0)
    # Zero the bias: the choice changes, and so do the logits (it is no dead weight).
    unbiased = rewrite(path, tmp_path / "unbiased", lambda t: {
        n: torch.zeros_like(v) if n.endswith("e_score_correction_bias") else v for n, v in t.items()})
    assert not torch.allclose(engine_logits(llm, PROMPT), engine_logits(engine(unbiased), PROMPT))


def test_the_multi_token_prediction_layer_is_skipped(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints("glm4_moe", **GLM)
    mtp = tmp_path / "mtp"
    shutil.copytree(path, mtp)
    # The Hub's checkpoints number it after the last decoder layer (GLM-4.5-Air: layer 46 of 46).
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(32, 64)},
              str(mtp / "model-mtp.safetensors"), metadata={"format": "pt"})
    reference = engine(path).generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    out = engine(mtp).generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_a_hub_style_config_rotates_what_transformers_does(tiny_checkpoints, tmp_path) -> None:
    """The Hub's config.json says rope_theta and partial_rotary_factor at the top level; with
    neither, transformers rotates half of each head."""
    path = tiny_checkpoints("glm4_moe", **GLM, partial_rotary_factor=0.25)

    def top_level(cfg: dict) -> dict:
        rope = cfg.pop("rope_parameters")
        return {**cfg, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}

    hub = rewrite(path, tmp_path / "hub", edit_config=top_level)
    llm = engine(hub)
    assert llm.engine.executor.driver_runner.model.rotary.cos_sin_cache.shape[1] == 4  # 16 x 0.25
    torch.testing.assert_close(engine_logits(llm, PROMPT), hf_logits(load_hf(hub), PROMPT), rtol=1e-4, atol=2e-4)

    def no_factor(cfg: dict) -> dict:
        cfg = top_level(cfg)
        del cfg["partial_rotary_factor"]
        return cfg

    default = rewrite(path, tmp_path / "default", edit_config=no_factor)
    llm = engine(default)
    assert llm.engine.executor.driver_runner.model.rotary.cos_sin_cache.shape[1] == 8  # 16 x 0.5
    torch.testing.assert_close(engine_logits(llm, PROMPT), hf_logits(load_hf(default), PROMPT), rtol=1e-4, atol=2e-4)


def test_a_missing_correction_bias_is_named(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints("glm4_moe", **GLM)
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    broken = rewrite(path, tmp_path / "broken", lambda t: {n: v for n, v in t.items() if n != name})
    with pytest.raises(ValueError, match=f"lacks weights for: {name}"):
        engine(broken)


def test_the_layers_are_dense_then_sparse(tiny_checkpoints) -> None:
    from stoker.layers.moe import FusedMoE
    from stoker.models.llama import LlamaMLP

    layers = engine(tiny_checkpoints("glm4_moe", **GLM)).engine.executor.driver_runner.model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP)  # first_k_dense_replace=1
    for layer in layers[1:]:
        assert isinstance(layer.mlp.experts, FusedMoE) and layer.mlp.shared_experts is not None
        assert layer.self_attn.o_proj.has_bias is False and layer.self_attn.qkv_proj.has_bias is True
