import json
import re
import shutil

import pytest
import torch

from stoker import LLM, SamplingParams
from tests.model.helpers import hf_greedy, load_hf


def test_sharded_checkpoint_loads_and_matches(tiny_checkpoints, tmp_path) -> None:
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=4 << 20)
    ids = [0, 11, 22, 33, 44, 55]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(load_hf(path), ids, 8)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_names_the_supported_ones(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    from stoker.models.registry import supported_architectures

    names = supported_architectures()
    assert {"LlamaForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM",
            "Gemma2ForCausalLM", "Gemma3ForCausalLM"} <= set(names)
    with pytest.raises(ValueError, match="not supported; supported: " + re.escape(", ".join(names))):
        LLM(str(path))


def test_missing_files_are_named(tiny_llama, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    path = _copy(tiny_llama, tmp_path / "noweights")
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(str(path))
    path = _copy(tiny_llama, tmp_path / "noconfig")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(path))


def test_shape_mismatch_names_the_tensor(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96  # checkpoint holds 128
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape .*mlp"):
        LLM(str(path))


def test_missing_tensor_is_named(tiny_llama, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_llama, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.post_attention_layernorm.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        LLM(str(path))


def test_unsupported_rope_type_is_named(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported; supported: default, linear, llama3, yarn, longrope"):
        LLM(str(path))


def test_unsupported_hidden_act_is_named(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = "quick_gelu"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported; supported: silu, swish, gelu"):
        LLM(str(path))


def test_dtype_auto_is_float32_on_cpu(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 20, device="cpu")
    assert llm.engine.executor.driver_runner.dtype == torch.float32
    assert llm.engine.max_model_len == 1024  # max_position_embeddings


def test_generation_config_eos_list(tiny_llama, tmp_path) -> None:
    path = _copy(tiny_llama, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 1]}))
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 20)
    assert llm.engine.eos_token_ids == (4, 1)
