"""GGUF files with 4-bit tensors (Q4_0, Q4_K) run on the int4 method (layers/int4_method.py),
decoded exactly (quantization/gguf_blocks.py): prefill logits equal HF transformers' on the
weights the file stands for (gguf's dequantize) to float32 tolerance, greedy tokens over 16
steps are the same, and the projections hold the packed 4-bit codes, not floats. Merged
projections with 4-bit beside 8-bit shards (llama.cpp's Q4_K_M) are tests/model/test_gguf_mixed.py's.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.embedding import LMHead
from stoker.layers.int4_method import Int4LinearMethod
from stoker.layers.linear import Linear
from stoker.layers.quantized_method import QuantizedLinearMethod
from stoker.testing.gguf_checkpoint import quantize_q4_k, write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

WIDE = dict(hidden_size=256, intermediate_size=256)  # K-quants: rows of whole 256-value super-blocks
PROMPTS = [[0] + list(range(7, 60)), [0, 99, 5, 17, 256, 800, 3]]
CASES = {
    # every projection Q4_0 (q/k rows permuted in the file), the LM head Q8_0
    "llama-q4_0": ("llama", {}, {r"proj\.weight": "Q4_0", r"embed_tokens|lm_head": "Q8_0"}),
    # every projection Q4_K (asymmetric: per-sub-block minimums)
    "llama-q4_k": ("llama", {}, {r"proj\.weight": "Q4_K", r"embed_tokens|lm_head": "Q8_0"}),
    # Q4_0 and Q4_K shards in one merged q/k/v; the LM head is the tied token_embd's Q4_0 blocks
    "qwen3-mixed": ("qwen3", dict(head_dim=32, tie_word_embeddings=True),
                    {r"q_proj|v_proj|o_proj|up_proj": "Q4_0", r"proj\.weight": "Q4_K", r"embed_tokens": "Q4_0"}),
}


def _linears(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.executor.driver_runner.model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("case", list(CASES))
def test_q4_file_matches_hf_on_dequantized_weights(case: str, tiny_checkpoints, tmp_path) -> None:
    arch, overrides, types = CASES[case]
    src = tiny_checkpoints(arch, **WIDE, **overrides)
    (tmp_path / "file").mkdir()
    path = write_gguf(src, tmp_path / "file" / "model.gguf", types, arch, dequantized_dst=tmp_path / "deq")
    copy_demo_tokenizer(tmp_path / "file")
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20, device="cpu")
    linears = _linears(llm)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj",
                 "model.layers.1.mlp.down_proj"):
        layer = linears[name]
        assert isinstance(layer.method, Int4LinearMethod) and layer.method.group_k == 32, name
        # the packed 4-bit codes (two to a byte, panel padding aside), not a float copy
        assert layer.weight.dtype == torch.uint8, name
        assert layer.weight.numel() <= layer.out_features * layer.in_features // 2 * 1.25, name
    head = linears["lm_head"]
    assert isinstance(head, LMHead) and head.tied_embedding is None
    assert isinstance(head.method, Int4LinearMethod if arch == "qwen3" else QuantizedLinearMethod)
    hf = load_hf(tmp_path / "deq")
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 16)


def test_q4_k_writer_round_trips() -> None:
    """The test's Q4_K blocks are what ggml reads: gguf's dequantize gives back the weights to
    within (a little over) half a step of each 32-value sub-block."""
    w = np.random.default_rng(2).normal(0, 0.1, size=(8, 512)).astype(np.float32)
    deq = gguf.quants.dequantize(quantize_q4_k(w), gguf.GGMLQuantizationType.Q4_K)
    x = w.reshape(8, -1, 32)
    step = (x.max(axis=-1) - np.minimum(x.min(axis=-1), 0)) / 15
    assert (np.abs(deq - w).reshape(8, -1, 32).max(axis=-1) <= 0.55 * step).all()
