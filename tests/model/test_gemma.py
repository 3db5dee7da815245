"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random checkpoints.

Per configuration: prefill logits within float32 tolerance; greedy output of one mixed batch
(lengths 1 to 180 against a 24-token window, shared prefixes, chunked prefill forced by a
64-token budget, prefix-cache hits, preemption forced by a small KV cache) equal, prompt by
prompt, to HF's greedy path for that prompt alone, each generated token's logprob within 1e-4.
`query_pre_attn_scalar` 16 (scale 1/4 for head_dim 16) and small caps make the soft-capping bite.
Then what the families read from config.json (windows, rotary bases, the multimodal text tower's
names) and what they refuse, online int8, and the roofline's count of the weights held.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from stoker import LLM, SamplingParams
from tests.model.helpers import check_mixed_batch_vs_hf, engine_logits, hf_logits, load_hf, mixed_batch_prompts

WINDOW = 24
CONFIGS = {
    # sliding and full layers alternating, attention and final logits soft-capped
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                              attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    # 2 local : 1 global, q/k norms, local base 10 000 and a linearly scaled global rotary;
    # a final soft cap set (honoured as transformers does), a tied LM head
    "gemma3_text": ("gemma3_text", dict(
        head_dim=16, sliding_window=WINDOW, num_hidden_layers=3, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], final_logit_softcapping=6.0,
        tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_batch_prompts()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_hf(name, tiny_checkpoints, prompts) -> None:
    path = tiny_checkpoints(CONFIGS[name][0], **CONFIGS[name][1])
    llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20)
    hf = load_hf(path)
    ids = prompts[5]  # 180 tokens: every window layer drops most of them
    torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_mixed_batch_matches_hf_alone(name, tiny_checkpoints, prompts) -> None:
    path = tiny_checkpoints(CONFIGS[name][0], **CONFIGS[name][1])
    # 24 blocks x 16 = 384 tokens of KV for ~600: preemption is certain; a 64-token budget
    # splits every long prompt into chunks.
    check_mixed_batch_vs_hf(path, prompts, max_new=12)


def test_layers_take_their_windows_caps_and_rotary_bases(tiny_checkpoints) -> None:
    def model(name):
        path = tiny_checkpoints(CONFIGS[name][0], **CONFIGS[name][1])
        return LLM(str(path), max_model_len=128, kv_cache_memory_bytes=1 << 20).engine.executor.driver_runner.model

    gemma2 = model("gemma2")
    assert [a.sliding_window for a in gemma2.attention_layers()] == [WINDOW, None]
    assert all(a.logits_soft_cap == 3.0 and a.scale == 0.25 for a in gemma2.attention_layers())
    gemma3 = model("gemma3_text")
    attns = [layer.self_attn for layer in gemma3.model.layers]
    assert [a.attn.sliding_window for a in attns] == [WINDOW, WINDOW, None]
    assert all(a.attn.logits_soft_cap is None for a in attns)
    assert attns[0].rotary is attns[1].rotary is gemma3.rotary_local and attns[2].rotary is gemma3.rotary
    # position 1's angle of the first pair: 1 (base 10 000, local), 1/8 (linear factor 8, global)
    assert gemma3.rotary_local.cos_sin_cache[1, 0].item() == pytest.approx(torch.cos(torch.tensor(1.0)).item())
    assert gemma3.rotary.cos_sin_cache[1, 0].item() == pytest.approx(torch.cos(torch.tensor(0.125)).item())


def test_configs_written_before_layer_types_and_rope_parameters() -> None:
    """Hub configs of transformers 4: no layer_types (Gemma 2 alternates; Gemma 3 by
    sliding_window_pattern), Gemma 3's rope_theta / rope_local_base_freq / rope_scaling."""
    from stoker.models.gemma2 import Gemma2ForCausalLM
    from stoker.models.gemma3 import Gemma3ForCausalLM, rope_configs

    cfg = {"num_hidden_layers": 6, "sliding_window": 8}
    assert [Gemma2ForCausalLM.sliding_window(cfg, i) for i in range(6)] == [8, None] * 3
    assert [Gemma3ForCausalLM.sliding_window(cfg, i) for i in range(6)] == [8] * 5 + [None]
    cfg3 = {**cfg, "sliding_window_pattern": 3}
    assert [Gemma3ForCausalLM.sliding_window(cfg3, i) for i in range(6)] == [8, 8, None] * 2
    full, local = rope_configs({"rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert full["rope_parameters"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert local["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e4}


def test_the_roofline_reads_a_hub_multimodal_config(tmp_path) -> None:
    """gemma-3-27b-it's config.json shape (text_config lists only what differs from transformers'
    defaults: no vocab_size): the roofline prices its language model as the preset does."""
    from stoker.roofline.modelspec import get_model_spec

    text = dict(head_dim=128, hidden_size=5376, intermediate_size=21504, model_type="gemma3_text",
                num_attention_heads=32, num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168,
                rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)
    cfg = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=text,
               vision_config=dict(hidden_size=1152, model_type="siglip_vision_model"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec, preset = get_model_spec(str(tmp_path)), get_model_spec("gemma-3-27b")
    assert (spec.num_params, spec.vocab_size, spec.num_sliding_layers) == (preset.num_params, 262_208, 52)
    assert spec.tie_word_embeddings and spec.qk_norm and spec.norms_per_layer == 4


def test_what_the_families_refuse(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints(CONFIGS["gemma3_text"][0], **CONFIGS["gemma3_text"][1])
    for field, value, match in (("use_bidirectional_attention", True, "use_bidirectional_attention"),
                                ("attn_logit_softcapping", 50.0, "attn_logit_softcapping")):
        edited = shutil.copytree(path, tmp_path / field)
        cfg = json.loads((edited / "config.json").read_text())
        cfg[field] = value
        (edited / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=match):
            LLM(str(edited), max_model_len=128, kv_cache_memory_bytes=1 << 20)


def _tiny_multimodal(path):
    """A Gemma3ForConditionalGeneration with a tiny SigLIP tower, as transformers 5 saves it."""
    import transformers

    from stoker.testing.tiny_checkpoint import TINY, copy_demo_tokenizer

    text = dict(TINY, head_dim=16, sliding_window=WINDOW, num_hidden_layers=3, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"], bos_token_id=0,
                eos_token_id=4, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=1000, boi_token_index=1001, eoi_token_index=1002)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.15 if "embed" in name else 0.08 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    copy_demo_tokenizer(path)
    return model


def test_the_text_tower_of_a_multimodal_checkpoint(tmp_path, prompts) -> None:
    """Both namings of the language model load (the Hub's language_model.model.*, which
    transformers still writes, and its module path model.language_model.*), the vision tower is
    left out, and text prompts give HF's multimodal model's logits."""
    from safetensors.torch import load_file, save_file

    hf = _tiny_multimodal(tmp_path / "hub")
    ids = prompts[4]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()
    other = shutil.copytree(tmp_path / "hub", tmp_path / "module-path")
    tensors = load_file(other / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors) and any(k.startswith("vision_tower.") for k in tensors)
    renamed = {k.replace("language_model.model.", "model.language_model.").replace("vision_tower.", "model.vision_tower.")
               .replace("multi_modal_projector.", "model.multi_modal_projector."): v for k, v in tensors.items()}
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    for path in (tmp_path / "hub", other):
        llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=4 << 20)
        assert llm.engine.hf_config["hidden_size"] == 64
        torch.testing.assert_close(engine_logits(llm, ids), want, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("quantization, kv", [("int8", "auto"), ("none", "fp8")])
def test_int8_weights_and_fp8_kv_stay_close_to_the_float_model(quantization, kv, tiny_checkpoints) -> None:
    """tests/model/test_online_quantization.py's bounds (int8 weights: mean KL <= 6e-4, top-1 >= 0.93;
    FP8 KV cache: 2e-3, 0.88), teacher-forced over 256 positions of Gemma 2 (soft caps, a window)."""
    from tests.model.test_online_quantization import BOUNDS, kl_and_top1

    path = tiny_checkpoints(CONFIGS["gemma2"][0], **CONFIGS["gemma2"][1])
    ids = [0] + [random.Random(0).randrange(5, 1000) for _ in range(255)]
    ref = engine_logits(LLM(str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20), ids)
    out = engine_logits(LLM(str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20, kv_cache_dtype=kv,
                            quantization=None if quantization == "none" else quantization), ids)
    kl, top1 = kl_and_top1(ref, out)
    max_kl, min_top1 = BOUNDS[(quantization, kv)]
    assert 0 < kl <= max_kl and top1 >= min_top1, (kl, top1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_norm_scales_by_one_plus_w_in_float32_as_transformers(dtype) -> None:
    """GemmaRMSNorm against transformers' Gemma2RMSNorm: bit for bit in bfloat16 (scaled in float32,
    then cast), to float32 rounding in float32 (the kernel set's RMSNorm with the weight 1 + w)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from stoker.layers.norm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype), torch.randn(64)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        ours = GemmaRMSNorm(64, 1e-6)
    finally:
        torch.set_default_dtype(previous)
    ref = Gemma2RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours(x), ref(x), **tol)
    normed, summed = ours(x, res)
    torch.testing.assert_close(summed, x + res, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref(x + res), **tol)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_roofline_counts_the_bytes_held(name, tiny_checkpoints, monkeypatch) -> None:
    """The spec parsed from config.json counts every parameter the engine holds (the four norms
    per layer, Gemma 3's q/k norms)."""
    from stoker.roofline.modelspec import spec_from_config

    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")  # no panel padding
    llm = LLM(str(tiny_checkpoints(CONFIGS[name][0], **CONFIGS[name][1])), max_model_len=128,
              kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.executor.driver_runner
    spec = spec_from_config(runner.hf_config)
    assert spec.num_sliding_layers == {"gemma2": 1, "gemma3_text": 2}[name] and spec.sliding_window == WINDOW
    assert runner.weight_bytes_held() == spec.weight_bytes("fp32", rest_dtype="fp32")


def test_lora_equals_peft(tiny_checkpoints, tmp_path) -> None:
    """A PEFT adapter on every projection of Gemma 2 (the GeGLU gate/up included): greedy tokens as PEFT's."""
    from stoker import LoRARequest
    from tests.model.helpers import make_adapter, peft_greedy

    base = tiny_checkpoints(CONFIGS["gemma2"][0], **CONFIGS["gemma2"][1])
    adapter = make_adapter(base, tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"], 8, seed=1)
    llm = LLM(str(base), max_model_len=128, kv_cache_memory_bytes=4 << 20, enable_lora=True, max_lora_rank=8)
    prompts = [[1, 17, 300, 42, 7, 99, 5], [600, 2, 3]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))]
    assert got == [peft_greedy(base, adapter, p, 10) for p in prompts]
    base_out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
    assert base_out != got  # the adapter changed something
