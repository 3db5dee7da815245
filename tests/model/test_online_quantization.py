"""--quantization fp8|int8 and --kv-cache-dtype fp8 against the float model they come from.

Teacher-forced over 256 positions (one 256-token prompt's prefill logits, so the K/V of every
position go through the cache's store and the attention kernels read them back): top-1
agreement with the float model and the mean KL(float || quantized) of the next-token
distributions. The thresholds come from measurement on these tiny random models (hidden 64,
2 layers, seed 0; docs/quantization.md, "Quality", has the table):

                      mean KL        top-1
    int8 weights      1.2-1.9e-4     0.97-0.98
    fp8 weights       1.9-2.9e-3     0.88-0.92
    fp8 KV cache      1.9-6.1e-4     0.92-0.98
    int8 + fp8 KV     2.8-7.9e-4     0.94-0.97

Each bound is about 3x the worst measured mean KL and a few points under the worst top-1, so
another seed or ISA passes; a real fault does not: a scale off by 2x, or a KV cache read
without its scale, gives KL above 0.1 (tests below plant both). The quantized runs must also
differ from the float one (KL > 0): a test that cannot fail proves nothing.
"""

from __future__ import annotations


import pytest

from stoker import LLM
from tests.model.helpers import engine_logits, kl_and_top1, teacher_forced_positions

ARCHS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", dict(head_dim=32))}
BOUNDS = {  # (max mean KL, min top-1)
    ("int8", "auto"): (6e-4, 0.93),
    ("fp8", "auto"): (1e-2, 0.83),
    ("none", "fp8"): (2e-3, 0.88),
    ("int8", "fp8"): (2.5e-3, 0.90),
}


@pytest.fixture(scope="module")
def positions() -> list[int]:
    return teacher_forced_positions()


def _llm(path, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, device="cpu", max_model_len=512, **kw)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("quantization, kv", list(BOUNDS))
def test_quantized_model_stays_close_to_the_float_one(arch, quantization, kv, tiny_checkpoints, positions) -> None:
    family, overrides = ARCHS[arch]
    path = tiny_checkpoints(family, **overrides)
    ref = engine_logits(_llm(path), positions)
    out = engine_logits(_llm(path, quantization=None if quantization == "none" else quantization, kv_cache_dtype=kv), positions)
    kl, top1 = kl_and_top1(ref, out)
    max_kl, min_top1 = BOUNDS[quantization, kv]
    assert 0 < kl < max_kl and top1 >= min_top1, f"KL {kl:.2e}, top-1 {top1:.3f}"


def test_a_wrong_weight_scale_is_caught(tiny_llama, positions) -> None:
    """The bounds above are tight enough to see a scale off by 2x in one layer."""
    ref = engine_logits(_llm(tiny_llama), positions)
    llm = _llm(tiny_llama, quantization="int8")
    layer = llm.engine.executor.driver_runner.model.model.layers[0].mlp.down_proj
    layer.weight_scale.data *= 2
    kl, _ = kl_and_top1(ref, engine_logits(llm, positions))
    assert kl > BOUNDS["int8", "auto"][0] * 10


def test_a_kv_cache_read_without_its_scale_is_caught(tiny_llama, positions) -> None:
    ref = engine_logits(_llm(tiny_llama), positions)
    llm = _llm(tiny_llama, kv_cache_dtype="fp8")
    for attn in llm.engine.executor.driver_runner.model.attention_layers():
        attn.k_scale = attn.v_scale = 0.05  # stored with 0.05 ...
    broken = llm.engine.executor.driver_runner.model.attention_layers()[1]

    def forward_reading_with_scale_one(self, q, k, v):
        # store with the layer's scale, then read as if the scale were 1.0
        from stoker.kernels import ops
        from stoker.layers.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        ops.store_kvcache(k, v, self.k_cache, self.v_cache, md.slot_mapping, self.k_scale, self.v_scale)
        cu = [x - md.cu_seqlens_q[0] for x in md.cu_seqlens_q]
        return ops.paged_attention(q, self.k_cache, self.v_cache, md.block_tables, cu, md.context_lens_list, self.scale, self.sliding_window)

    broken.forward = forward_reading_with_scale_one.__get__(broken)
    kl, _ = kl_and_top1(ref, engine_logits(llm, positions))
    assert kl > BOUNDS["none", "fp8"][0] * 10


def test_fp8_kv_scales_other_than_one_stay_close(tiny_llama, positions) -> None:
    """A per-layer scale (as calibrated checkpoints carry) is applied on store and undone on read."""
    ref = engine_logits(_llm(tiny_llama), positions)
    llm = _llm(tiny_llama, kv_cache_dtype="fp8")
    for attn in llm.engine.executor.driver_runner.model.attention_layers():
        attn.k_scale, attn.v_scale = 0.011, 0.007
    kl, top1 = kl_and_top1(ref, engine_logits(llm, positions))
    max_kl, min_top1 = BOUNDS["none", "fp8"]
    assert 0 < kl < max_kl and top1 >= min_top1, f"KL {kl:.2e}, top-1 {top1:.3f}"
