"""DeepSeek-V2 / V3 (multi-head latent attention over a latent KV cache) against HF transformers
on tiny random checkpoints: prefill logits; greedy tokens of one mixed batch (prefix-cache
hits, chunked prefill, preemption) equal HF's token for token with logprobs within 1e-4; the
cache holds exactly kv_lora_rank + qk_rope_head_dim values per token and layer (one byte each
in an FP8 cache, within the dense FP8-KV quality bounds); absorbed decode equals the expanded
computation; what MLA does not support is refused by name.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.mla_attention import mla_absorbed_decode, mla_expanded_attention
from tests.model.helpers import check_mixed_batch_vs_hf, engine_logits, hf_greedy, hf_logits, load_hf, mixed_batch_prompts

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
           first_k_dense_replace=1, num_hidden_layers=3)
CONFIGS = {
    # q through a LoRA (q_a_proj, q_a_layernorm, q_b_proj), grouped sigmoid routing with its
    # correction bias, DeepSeek YaRN with mscale_all_dim (the softmax scale changes), interleaved rope
    "deepseek_v3": ("deepseek_v3", dict(MLA, **MOE, q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.7,
                                                          original_max_position_embeddings=256))),
    # V2-Lite's shape: a plain q_proj, softmax greedy router
    "deepseek_v2-lite": ("deepseek_v2", dict(MLA, **MOE, q_lora_rank=None, topk_method="greedy")),
    # V2's group-limited router (2 of 4 groups), scaled weights, q LoRA
    "deepseek_v2-group-limited": ("deepseek_v2", dict(MLA, **MOE, q_lora_rank=40, topk_method="group_limited_greedy",
                                                      n_group=4, topk_group=2, routed_scaling_factor=1.5)),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_batch_prompts(seed=2, lengths=(5, 40, 130), shared_tails=(1, 12))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_hf(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=4 << 20)
    hf = load_hf(path)
    for ids in (prompts[2], prompts[3]):
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2-lite"])
def test_greedy_mixed_batch_matches_hf_alone(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    # 14 blocks x 16 = 224 tokens of KV for ~330: preemption is certain; a 48-token budget
    # splits the long prompts into chunks.
    check_mixed_batch_vs_hf(path, prompts, max_new=12, num_blocks=14, max_model_len=192, budget=48)


def test_the_cache_holds_one_latent_per_token_and_layer(tiny_checkpoints, caplog) -> None:
    arch, overrides = CONFIGS["deepseek_v3"]
    with caplog.at_level(logging.INFO, logger="stoker.engine.llm_engine"):
        llm = LLM(str(tiny_checkpoints(arch, **overrides)), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.executor.driver_runner
    width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]  # 40 values, no heads, no V
    for k, v in runner.kv_caches:
        assert k.shape[2:] == (1, width) and v.numel() == 0
    per_token = 3 * width * 4  # 3 layers, float32
    assert runner.kv_spec.bytes_per_token == per_token
    assert runner.bytes_per_block == per_token * 16
    assert f"{per_token} bytes per token" in caplog.text
    assert len(runner.kv_caches) * runner.kv_caches[0][0].numel() * 4 == runner.bytes_per_block * runner.kv_caches[0][0].shape[0]


@pytest.mark.parametrize("context", [1, 7, 50])
def test_absorbed_decode_equals_expanded(context) -> None:
    g = torch.Generator().manual_seed(context)
    H, nope, rope, r, v = 4, 16, 8, 32, 24
    q_nope, q_pe = torch.randn(1, H, nope, generator=g), torch.randn(1, H, rope, generator=g)
    latents = torch.randn(context, r + rope, generator=g)
    w = torch.randn(H, nope + v, r, generator=g) / r**0.5
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    absorbed = mla_absorbed_decode(q_nope[0], q_pe[0], latents, w_uk, w_uv, 0.2)
    expanded = mla_expanded_attention(q_nope, q_pe, latents, w_uk, w_uv, 0.2)[0]
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    # and the expanded path is causal: the last query of a chunk equals that token decoding alone
    chunk = mla_expanded_attention(torch.randn(3, H, nope, generator=g).index_copy(0, torch.tensor([2]), q_nope),
                                   torch.randn(3, H, rope, generator=g).index_copy(0, torch.tensor([2]), q_pe),
                                   latents if context >= 3 else torch.randn(3, r + rope, generator=g),
                                   w_uk, w_uv, 0.2)
    if context >= 3:
        torch.testing.assert_close(chunk[2], absorbed, rtol=1e-5, atol=1e-5)


def decode_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits of every position, each token run as a one-token decode over the
    cache its predecessors filled: the absorbed decode path, (len(ids), vocab)."""
    from stoker.layers.attention import AttentionMetadata
    from stoker.layers.forward_context import ForwardContext, set_forward_context

    runner = llm.engine.executor.driver_runner
    table = torch.arange(-(-len(ids) // runner.block_size), dtype=torch.int32)[None]
    rows = []
    with torch.inference_mode():
        for t, token in enumerate(ids):
            md = AttentionMetadata(slot_mapping=torch.tensor([t]), block_tables=table,
                                   context_lens=torch.tensor([t + 1], dtype=torch.int32), cu_seqlens_q=[0, 1],
                                   context_lens_list=[t + 1], num_decodes=1)
            with set_forward_context(ForwardContext(md)):
                rows.append(runner.model.compute_logits(runner.model(torch.tensor([token]), torch.tensor([t]))))
    return torch.cat(rows)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2-lite"])
def test_fp8_kv_cache_stays_close_to_the_float_cache(name, tiny_checkpoints, caplog) -> None:
    """The latent stored as E4M3: a quarter of a float32 cache's bytes per token (the engine's
    log), and within the dense FP8-KV bounds (tests/model/test_online_quantization.py: mean KL
    <= 2e-3, top-1 >= 0.88 over the positions the float model decides by >= 0.05) for prefill
    (expanded over the cached latents) and for decode (absorbed: the C kernel, or the twin).
    The tiny V2-Lite's logits tie within 0.05 beyond its first ~30 positions (32 of 192
    decided), hence >= 24 decided positions asked; the mean KL covers all of them."""
    from tests.model.test_online_quantization import BOUNDS, kl_and_top1

    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    ids = [0] + [random.Random(0).randrange(5, 1000) for _ in range(191)]
    ref_llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=4 << 20)
    with caplog.at_level(logging.INFO, logger="stoker.engine.llm_engine"):
        fp8_llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=4 << 20, kv_cache_dtype="fp8")
    runner = fp8_llm.engine.executor.driver_runner
    width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    assert runner.kv_spec.bytes_per_token == 3 * width == ref_llm.engine.executor.driver_runner.kv_spec.bytes_per_token // 4
    assert f"{3 * width} bytes per token" in caplog.text
    assert fp8_llm.engine.block_manager.num_blocks == 4 * ref_llm.engine.block_manager.num_blocks
    for k, v in runner.kv_caches:
        assert k.dtype == torch.float8_e4m3fn and k.shape[2:] == (1, width) and v.numel() == 0
    max_kl, min_top1 = BOUNDS[("none", "fp8")]
    for logits in (engine_logits, decode_logits):
        ref, out = logits(ref_llm, ids), logits(fp8_llm, ids)
        top2 = ref.topk(2, -1).values
        decided = (top2[:, 0] - top2[:, 1]) >= 0.05
        kl, _ = kl_and_top1(ref, out)
        _, top1 = kl_and_top1(ref[decided], out[decided])
        assert int(decided.sum()) >= 24 and 0 < kl <= max_kl and top1 >= min_top1, (logits.__name__, kl, top1, int(decided.sum()))


def test_fp8_kv_cache_under_prefix_hits_chunks_and_preemption(tiny_checkpoints, prompts) -> None:
    """An FP8 latent cache through the engine's features gives the tokens of an FP8 engine that
    needs none of them (storing is elementwise: a token's bytes do not depend on how its prompt
    was split or recomputed), logprobs within 1e-4 (a recompute runs a generated token through
    the expanded path where it first went through the absorbed one)."""
    arch, overrides = CONFIGS["deepseek_v3"]
    path = str(tiny_checkpoints(arch, **overrides))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.check_integrity()
        return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]

    plain = run(LLM(path, max_model_len=192, kv_cache_memory_bytes=4 << 20, kv_cache_dtype="fp8",
                    enable_prefix_caching=False, enable_chunked_prefill=False))
    stressed_llm = LLM(path, max_model_len=192, kv_cache_dtype="fp8", num_gpu_blocks_override=14,
                       max_num_batched_tokens=48)
    stressed = run(stressed_llm)
    assert stressed_llm.engine.stats().num_preemptions > 0
    assert stressed_llm.engine.block_manager.prefix_cache_hits > 0
    assert [t for t, _ in stressed] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(stressed, plain):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


def test_checkpoint_kv_scale_is_the_latent_s(tiny_checkpoints, tmp_path, prompts) -> None:
    """A checkpoint's self_attn.k_scale becomes the latent's dequantization scale under an FP8
    cache (and changes what is stored); a non-positive one is refused by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    arch, overrides = CONFIGS["deepseek_v2-lite"]
    src = tiny_checkpoints(arch, **overrides)
    dst = tmp_path / "scaled"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for i in range(3):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(dst), max_model_len=256, kv_cache_memory_bytes=2 << 20, kv_cache_dtype="fp8")
    layers = llm.engine.executor.driver_runner.model.attention_layers()
    assert [a.k_scale for a in layers] == [0.25] * 3
    plain = LLM(str(src), max_model_len=256, kv_cache_memory_bytes=2 << 20, kv_cache_dtype="fp8")
    assert not torch.equal(engine_logits(llm, prompts[2]), engine_logits(plain, prompts[2]))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(-1.0)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_scale = -1.0: a KV-cache scale must be"):
        LLM(str(dst), max_model_len=64, kv_cache_memory_bytes=1 << 20, kv_cache_dtype="fp8")


def test_multi_token_prediction_layers_are_skipped(tiny_checkpoints, tmp_path, prompts) -> None:
    """V3's checkpoints carry the MTP module as layer num_hidden_layers; it loads and changes nothing."""
    import shutil

    from safetensors.torch import load_file, save_file

    arch, overrides = CONFIGS["deepseek_v3"]
    src = tiny_checkpoints(arch, **overrides)
    dst = tmp_path / "with_mtp"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.randn(4 * 40, 32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ids = prompts[2]
    a = engine_logits(LLM(str(dst), max_model_len=128, kv_cache_memory_bytes=1 << 20), ids)
    b = engine_logits(LLM(str(src), max_model_len=128, kv_cache_memory_bytes=1 << 20), ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_roofline_counts_the_bytes_held(name, tiny_checkpoints, monkeypatch) -> None:
    """spec_from_config prices MLA's projections, latent norms and routers as the engine holds them."""
    from stoker.roofline.modelspec import spec_from_config

    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")  # no panel padding
    arch, overrides = CONFIGS[name]
    llm = LLM(str(tiny_checkpoints(arch, **overrides)), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.executor.driver_runner
    spec = spec_from_config(runner.hf_config)
    assert runner.weight_bytes_held() == spec.weight_bytes("fp32", rest_dtype="fp32")
    assert spec.kv_bytes_per_token("fp32") == runner.kv_spec.bytes_per_token  # engine and planner agree


def test_mla_kv_bytes_in_the_roofline() -> None:
    from stoker.roofline.modelspec import get_model_spec

    v3 = get_model_spec("deepseek-v3")
    # 61 layers x (512 + 64) values x 2 bytes, the same on every TP rank
    assert v3.kv_bytes_per_token("bf16") == 61 * 576 * 2 == v3.kv_bytes_per_token("bf16", tp=8)
    # against 128 heads of K and V of 128 + 64 and 128 (what an MHA cache of V3's heads would hold)
    mha = 61 * 128 * (192 + 128) * 2
    assert mha / v3.kv_bytes_per_token("bf16") == pytest.approx(71.1, abs=0.1)
    # absorbed attention FLOPs per position: 2 x layers x heads x (2 x 512 + 64)
    assert v3.flops_per_token(1000)["attention"] == 2 * 61 * 128 * (2 * 512 + 64) * 1000


def test_block_fp8_checkpoint_matches_its_dequantized_weights(tiny_checkpoints, tmp_path, prompts) -> None:
    """DeepSeek's own format: every projection (kv_a_proj_with_mqa, kv_b_proj and the experts
    included) e4m3 in 128 x 128 blocks with weight_scale_inv; HF runs the dequantized weights."""
    from stoker.testing.quantized_checkpoint import quantize_checkpoint

    arch, overrides = CONFIGS["deepseek_v3"]
    src = tiny_checkpoints(arch, **overrides)
    quantized = quantize_checkpoint(src, tmp_path / "fp8", "fp8-block", dequantized_dst=tmp_path / "deq")
    llm = LLM(str(quantized), max_model_len=256, kv_cache_memory_bytes=2 << 20)
    hf = load_hf(tmp_path / "deq")
    for ids in (prompts[2], prompts[3]):
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:4]], params, use_tqdm=False)
    for ids, out in zip(prompts[1:4], outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)


def test_what_mla_cannot_honour_is_refused() -> None:
    from stoker.models.deepseek_v2 import check_mla_config

    class OneRank:
        world_size, rank, expert_parallel = 1, 0, False

    cfg = dict(CONFIGS["deepseek_v3"][1], architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ValueError, match="moe_layer_freq 2"):
        check_mla_config(dict(cfg, moe_layer_freq=2), OneRank())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no 'kv_lora_rank'"):
        check_mla_config({k: v for k, v in cfg.items() if k != "kv_lora_rank"}, OneRank())  # type: ignore[arg-type]
    check_mla_config(cfg, OneRank())  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [4, 16])
def test_c_decode_kernel_equals_its_twin(block_size) -> None:
    """kernels/cpu/mla_decode_attention.c against reference.mla_decode_attention: mixed context
    lengths (0 included), shuffled block tables; and a sequence's rows the same alone or in a batch."""
    from stoker.kernels import reference
    from stoker.kernels.cpu import build
    from stoker.kernels.cpu.mla_decode_attention import mla_decode_attention

    if not build.available():
        pytest.skip("no C compiler: the CPU kernel library is not built")
    g = torch.Generator().manual_seed(block_size)
    H, r, R = 6, 32, 8  # 6 heads: a partial task of heads
    lens = [0, 1, 5, 37, 64]
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks
    cache = torch.randn(num_blocks, block_size, 1, r + R, generator=g)
    tables = torch.randperm(num_blocks, generator=g).view(len(lens), max_blocks).to(torch.int32)
    q = torch.randn(len(lens), H, r + R, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int32)
    ours = mla_decode_attention(q, cache, tables, ctx, r, 0.15)
    torch.testing.assert_close(ours, reference.mla_decode_attention(q, cache, tables, ctx, r, 0.15), rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[0], torch.zeros(H, r))
    alone = mla_decode_attention(q[3:4], cache, tables[3:4], ctx[3:4], r, 0.15)
    assert torch.equal(alone[0], ours[3])  # batch-invariant, bit for bit
    fp8 = (cache / 0.05).to(torch.float8_e4m3fn)  # an FP8 cache of scale 0.05 (rank 32: vector and tail widening)
    ours = mla_decode_attention(q, fp8, tables, ctx, r, 0.15, 0.05)
    torch.testing.assert_close(ours, reference.mla_decode_attention(q, fp8, tables, ctx, r, 0.15, 0.05), rtol=1e-5, atol=1e-5)
    assert torch.equal(mla_decode_attention(q[3:4], fp8, tables[3:4], ctx[3:4], r, 0.15, 0.05)[0], ours[3])
    with pytest.raises(ValueError, match="outside"):
        bad = tables.clone()
        bad[4, 0] = num_blocks  # the first block of the 64-token sequence: read
        mla_decode_attention(q, cache, bad, ctx, r, 0.15)


def test_the_decode_kernel_is_chosen_from_the_bound_set(tiny_checkpoints, monkeypatch) -> None:
    """The builder binds each latent attention the device's kernel set (models/method_chooser.py),
    and the layer's absorbed decode follows from it: Triton for `triton` (CUDA), the C kernel for
    `cpu`, the twin otherwise (STOKER_DISABLE_CPU_KERNELS=1 here)."""
    from stoker.kernels import reference
    from stoker.kernels.cpu import build
    from stoker.kernels.cpu.mla_decode_attention import mla_decode_attention as c_kernel
    from stoker.kernels.mla_decode_attention import mla_decode_attention as triton_kernel
    from stoker.layers.mla_kernels import decode_kernel

    assert decode_kernel("triton") is triton_kernel and decode_kernel("cpu") is c_kernel
    assert decode_kernel("torch") is reference.mla_decode_attention
    arch, overrides = CONFIGS["deepseek_v2-lite"]
    path = str(tiny_checkpoints(arch, **overrides))
    if build.available():
        llm = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 20)
        assert {a.kernels.name for a in llm.engine.executor.driver_runner.model.attention_layers()} == {"cpu"}
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    llm = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert {a.kernels.name for a in llm.engine.executor.driver_runner.model.attention_layers()} == {"torch"}
