"""Phi-3, OLMo 2, Granite 3 and SmolLM3 against HF transformers on tiny random checkpoints.

Per configuration: prefill logits within float32 tolerance; greedy output of one mixed batch
(lengths 1 to 180, shared prefixes, chunked prefill forced by a 64-token budget, prefix-cache
hits, preemption forced by a small KV cache) equal, prompt by prompt, to HF's greedy path for
that prompt alone; the logprob of each generated token within 1e-4 of HF's; the block manager
whole afterwards (tests/model/test_moe_families.py's pattern). LongRoPE both ways: the short
factors on an engine whose max_model_len stays within original_max_position_embeddings, the
long ones on an engine past it, for prompts longer than it (where transformers uses them too).
"""

from __future__ import annotations

import random

import pytest
import torch

from stoker import LLM, SamplingParams
from tests.model.helpers import check_mixed_batch_vs_hf, engine_logits, hf_logits, load_hf, mixed_batch_prompts


def longrope(num_factors: int, original: int) -> dict:
    """Phi-3's rope_scaling with made-up, clearly different short and long factor lists."""
    return dict(rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(num_factors)],
                              "long_factor": [1.0 + 3.0 * i for i in range(num_factors)]},
                original_max_position_embeddings=original)


CONFIGS = {
    # LongRoPE past the pretraining length (max_model_len 256 > 32: the long factors, which
    # transformers also uses for these prompts, all longer than 32), half the head rotated, a window
    "phi3": ("phi3", dict(partial_rotary_factor=0.5, sliding_window=48, **longrope(4, 32))),
    "olmo2": ("olmo2", dict()),
    "granite": ("granite", dict(embedding_multiplier=4.0, residual_multiplier=0.3, attention_multiplier=0.1,
                                logits_scaling=3.0, tie_word_embeddings=True)),
    # NoPE on layer 1, a window on that layer only (use_sliding_window)
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=40)),
}
# LongRoPE within the pretraining length (max_model_len 256 < 512: the short factors, with the
# attention factor of max_position_embeddings / 512 = 2)
PHI3_SHORT = ("phi3", dict(partial_rotary_factor=0.5, **longrope(4, 512)))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_batch_prompts()


def check_mixed_batch(path, prompts: list[list[int]], long_rope: bool = False) -> None:
    # transformers rotates a sequence within the pretraining length (32 here) with the short factors
    check_mixed_batch_vs_hf(path, prompts, max_new=10, skip=(lambda ids: len(ids) <= 32) if long_rope else None)


@pytest.mark.parametrize("name", [*CONFIGS, "phi3-short"])
def test_prefill_logits_match_hf(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = PHI3_SHORT if name == "phi3-short" else CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    hf = load_hf(path)
    for ids in (prompts[3], prompts[5]):
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_mixed_batch_matches_hf_alone(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = CONFIGS[name]
    check_mixed_batch(tiny_checkpoints(arch, **overrides), prompts, long_rope=name == "phi3")


def test_longrope_factor_list_follows_max_model_len(tiny_checkpoints) -> None:
    """Within the pretraining length the short factors (transformers' choice for a sequence of
    at most 32 tokens); the two engines' rotations differ, so each check can fail."""
    path = tiny_checkpoints("phi3", **CONFIGS["phi3"][1])
    hf = load_hf(path)
    ids = list(range(7, 7 + 30))
    short = LLM(str(path), max_model_len=32, kv_cache_memory_bytes=1 << 20)
    torch.testing.assert_close(engine_logits(short, ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-4)
    long = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert (engine_logits(long, ids) - hf_logits(hf, ids)).abs().max() > 1e-2  # HF: short at 30 tokens


def test_longrope_inverse_frequencies_equal_transformers() -> None:
    """The factor lists and the attention factor, against transformers' own computation."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from stoker.layers.longrope import longrope_inv_freq
    from stoker.layers.rotary import rope_parameters

    rs = {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0, 5.0, 9.0, 17.0]}
    hf_cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5,
                                     max_position_embeddings=4096, original_max_position_embeddings=512, rope_scaling=rs)
    cfg = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, original_max_position_embeddings=512,
               partial_rotary_factor=0.5, rope_scaling=rs)
    p = rope_parameters(cfg)
    for seq_len, max_position in ((None, 512), (513, 513)):
        want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, None, seq_len=seq_len)
        got, factor = longrope_inv_freq(10000.0, 8, p, cfg, max_position)
        torch.testing.assert_close(got, want)
        assert factor == pytest.approx(want_factor) and factor > 1.1


def test_family_layers_are_what_the_config_says(tiny_checkpoints) -> None:
    from stoker.layers.rotary import RotaryEmbedding
    from stoker.models.smollm3 import NoRotary

    arch, overrides = CONFIGS["smollm3"]
    llm = LLM(str(tiny_checkpoints(arch, **overrides)), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    attns = [layer.self_attn for layer in llm.engine.executor.driver_runner.model.model.layers]
    assert [type(a.rotary) for a in attns] == [RotaryEmbedding, NoRotary]
    assert [a.attn.sliding_window for a in attns] == [None, 40]


def test_config_fields_as_transformers_reads_them(tiny_checkpoints, tmp_path) -> None:
    """A Granite multiplier left out of config.json is 1.0, as in transformers; projection biases
    on Phi-3 (which transformers' Phi3 does not build) are refused by name."""
    import json
    import shutil

    from stoker.models.granite import granite_config

    assert granite_config({"embedding_multiplier": 12.0})["logits_scaling"] == 1.0
    bad = tmp_path / "phi3"
    shutil.copytree(tiny_checkpoints("phi3", **PHI3_SHORT[1]), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["attention_bias"] = True
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="attention_bias"):
        LLM(str(bad), max_model_len=64, kv_cache_memory_bytes=1 << 20)


def test_phi3_lora_on_stacked_projections_equals_peft(tiny_checkpoints, tmp_path) -> None:
    """A PEFT adapter trained on Phi-3 targets its stacked qkv_proj and gate_up_proj: one A,
    B over the q, k, v (gate, up) rows; Stoker serves it on its merged layers' shards."""
    from stoker import LoRARequest
    from tests.model.helpers import make_adapter, peft_greedy

    base = tiny_checkpoints("phi3", **PHI3_SHORT[1])  # short factors: the prompts are within the pretraining length
    adapter = make_adapter(base, tmp_path / "a", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 8, seed=1)
    llm = LLM(str(base), max_model_len=128, kv_cache_memory_bytes=4 << 20, enable_lora=True, max_lora_rank=8)
    prompts = [[1, 17, 300, 42, 7, 99, 5, 600, 2, 3]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                         use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))]
    assert got == [peft_greedy(base, adapter, p, 8) for p in prompts]
    base_out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                              use_tqdm=False)]
    assert base_out != got  # the adapter changed something


@pytest.mark.parametrize("fmt", ["fp8-tensor", "ct-int8-pack-group", "ct-fp8-channel"])
def test_phi3_prequantized_stacked_tensors(tiny_checkpoints, tmp_path, fmt: str) -> None:
    """A quantized Phi-3 checkpoint stacks qkv_proj and gate_up_proj with their scales: per-tensor
    (one scale for q, k and v), per-channel and per-group scales cut with the rows, and
    compressed-tensors' weight_shape of the stacked tensor. Equal to HF on the dequantized weights."""
    from stoker.testing.quantized_checkpoint import quantize_checkpoint

    src = tiny_checkpoints("phi3", **PHI3_SHORT[1])
    q = quantize_checkpoint(src, tmp_path / "q", fmt, dequantized_dst=tmp_path / "deq")
    llm = LLM(str(q), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    ids = [0] + list(range(7, 60))
    torch.testing.assert_close(engine_logits(llm, ids), hf_logits(load_hf(tmp_path / "deq"), ids), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("name", ["phi3", "olmo2", "granite"])
def test_the_roofline_counts_the_bytes_held(name, tiny_checkpoints, monkeypatch) -> None:
    """The spec parsed from config.json counts every parameter the engine holds (OLMo 2's q/k
    norms over the whole projection, Granite's tied head)."""
    from stoker.roofline.modelspec import spec_from_config

    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")  # no panel padding
    arch, overrides = CONFIGS[name]
    llm = LLM(str(tiny_checkpoints(arch, **overrides)), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.executor.driver_runner
    assert runner.weight_bytes_held() == spec_from_config(runner.hf_config).weight_bytes("fp32", rest_dtype="fp32")


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("quantization, kv", [("int8", "auto"), ("none", "fp8")])
def test_int8_weights_and_fp8_kv_stay_close_to_the_float_model(name, quantization, kv, tiny_checkpoints) -> None:
    """tests/model/test_online_quantization.py's bounds (int8 weights: mean KL <= 6e-4, top-1 >= 0.93;
    FP8 KV cache: 2e-3, 0.88), teacher-forced over 256 positions of each family."""
    from tests.model.helpers import engine_logits
    from tests.model.test_online_quantization import BOUNDS, kl_and_top1

    path = tiny_checkpoints(CONFIGS[name][0], **CONFIGS[name][1])
    ids = [0] + [random.Random(0).randrange(5, 1000) for _ in range(255)]
    ref = engine_logits(LLM(str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20), ids)
    out = engine_logits(LLM(str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20, kv_cache_dtype=kv,
                            quantization=None if quantization == "none" else quantization), ids)
    # Top-1 over the positions the float model decides (top-1 logit >= 0.05 above the second):
    # the tiny OLMo 2's logits tie within 0.05 at 161 of 256 positions, where any rounding flips
    # the argmax (its mean KL is 8x under the bound); the other families have no such ties.
    top2 = ref.topk(2, -1).values
    decided = (top2[:, 0] - top2[:, 1]) >= 0.05
    kl, _ = kl_and_top1(ref, out)
    _, top1 = kl_and_top1(ref[decided], out[decided])
    max_kl, min_top1 = BOUNDS[(quantization, kv)]
    assert int(decided.sum()) >= 64 and 0 < kl <= max_kl and top1 >= min_top1, (kl, top1, int(decided.sum()))
