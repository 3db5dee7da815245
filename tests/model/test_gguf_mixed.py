"""GGUF files typed as llama.cpp's k-quant mixes type them (stoker/testing/gguf_checkpoint.py
llama_cpp_types: Q4_K_M, Q4_K_S, Q5_K_M): merged q/k/v layers whose shards mix 4-bit and
8-bit types run one method per run of shards (layers/composite_method.py), Q5_K and Q5_1 run
on the affine int8 method (layers/int8_affine_method.py), Q5_0 / Q4_1 on the int8 / int4
methods; prefill logits equal HF transformers' on the dequantized weights (gguf's dequantize)
to float32 tolerance and greedy tokens over 32 steps are the same. Types with no exact method
are still refused by name.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.composite_method import CompositeLinearMethod
from stoker.layers.int4_method import Int4LinearMethod
from stoker.layers.int8_affine_method import AffineInt8, AffineInt8LinearMethod, dequantize
from stoker.layers.linear import Linear, MergedLinear
from stoker.layers.quantized_method import QuantizedLinearMethod
from stoker.quantization import gguf_blocks
from stoker.quantization.config import QuantizationError
from stoker.testing.gguf_checkpoint import llama_cpp_types, quantize_k_affine, write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

WIDE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2)  # K-quants: whole 256-value rows
PROMPTS = [[0] + list(range(7, 60)), [0, 99, 5, 17, 256, 800, 3]]
CASES = {
    # layer 0: Q4_K q/k/v; layer 1 (a "more bits" layer): Q4_K q/k beside Q6_K v, Q6_K down
    "llama-q4_k_m": ("llama", {}, llama_cpp_types("Q4_K_M", 2)),
    # biases on q/k/v; embeddings tied, so token_embd is Q6_K and serves the LM head
    "qwen2-q4_k_m": ("qwen2", dict(tie_word_embeddings=True), llama_cpp_types("Q4_K_M", 2, tied=True)),
    # Q4_K q/k beside Q5_K v (affine int8) in both layers (the first four); ffn_down Q5_K only in
    # the first eighth of the layers: none of two
    "qwen3-q4_k_s": ("qwen3", dict(head_dim=64), llama_cpp_types("Q4_K_S", 2)),
    # Q5_K everywhere (affine int8), Q6_K v and down in layer 1: one affine int8 method at groups of 16
    "llama-q5_k_m": ("llama", {}, llama_cpp_types("Q5_K_M", 2)),
    # llama.cpp's fallbacks for rows that are not whole super-blocks: Q5_0 (for Q4_K), Q5_1 (for
    # Q5_K), Q8_0 (for Q6_K); Q4_1 (a Q4_0 file's ffn_down with an imatrix) beside them
    "qwen2-fallbacks": ("qwen2", {}, {r"[qk]_proj\.weight": "Q5_0", r"v_proj\.weight": "Q8_0", r"gate_proj": "Q5_1",
                                      r"up_proj": "Q4_1", r"down_proj": "Q4_1", r"proj\.weight|lm_head": "Q5_0",
                                      r"embed_tokens": "Q5_1"}),
}


def _linears(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.executor.driver_runner.model.named_modules() if isinstance(m, Linear)}


def _check_methods(case: str, linears: dict[str, Linear]) -> None:
    qkv0, qkv1 = (linears[f"model.layers.{i}.self_attn.qkv_proj"].method for i in (0, 1))
    if case.endswith("q4_k_m"):
        assert isinstance(qkv0, Int4LinearMethod)
        assert isinstance(qkv1, CompositeLinearMethod) and [s for s, _ in qkv1.runs] == [("q", "k"), ("v",)]
        assert isinstance(qkv1.runs[0][1], Int4LinearMethod) and isinstance(qkv1.runs[1][1], QuantizedLinearMethod)
        assert qkv1.runs[1][1].group_k == 16
        # the runs' 4-bit codes and 8-bit codes are the layer's parameters (the byte count sees them)
        params = dict(linears["model.layers.1.self_attn.qkv_proj"].named_parameters())
        assert params["part0_weight"].dtype == torch.uint8 and params["part1_weight"].dtype == torch.int8
    elif case == "qwen3-q4_k_s":
        for m in (qkv0, qkv1):
            assert isinstance(m, CompositeLinearMethod) and isinstance(m.runs[1][1], AffineInt8LinearMethod)
    elif case == "llama-q5_k_m":
        assert isinstance(qkv0, AffineInt8LinearMethod) and qkv0.group_k == 32
        assert isinstance(qkv1, AffineInt8LinearMethod) and qkv1.group_k == 16  # Q5_K q/k beside Q6_K v
    else:
        assert isinstance(qkv0, QuantizedLinearMethod) and qkv0.group_k == 32
        gate_up = linears["model.layers.0.mlp.gate_up_proj"].method  # Q5_1 gate beside Q4_1 up
        assert isinstance(gate_up, CompositeLinearMethod)
        assert [type(m) for _, m in gate_up.runs] == [AffineInt8LinearMethod, Int4LinearMethod]


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_mix_matches_hf_on_dequantized_weights(case: str, tiny_checkpoints, tmp_path) -> None:
    arch, overrides, types = CASES[case]
    src = tiny_checkpoints(arch, **WIDE, **overrides)
    (tmp_path / "file").mkdir()
    path = write_gguf(src, tmp_path / "file" / "model.gguf", types, arch, dequantized_dst=tmp_path / "deq")
    copy_demo_tokenizer(tmp_path / "file")
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20, device="cpu")
    _check_methods(case, _linears(llm))
    # decode steps in one C call where every run is one C kernel (the affine int8 runs are not)
    assert (llm.engine.executor.driver_runner.cpu_decode is not None) == case.endswith("q4_k_m")
    hf = load_hf(tmp_path / "deq")
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("kind", ["Q5_K", "Q5_1"])
def test_affine_int8_form_is_gguf_dequantize_bit_for_bit(kind: str) -> None:
    """Random blocks (finite fp16 d and dmin / m): the codes, scales and offsets the method holds,
    dequantized as it defines (q * scale, exact, + offset, one rounding), are gguf-py's
    dequantize bit for bit, also at a finer group (the scales and offsets repeated)."""
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, size=(5, 4, gguf_blocks.BLOCK_BYTES[kind]), dtype=np.uint8)
    raw[..., 0:4] = rng.normal(0, 0.02, size=(5, 4, 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(5, -1)
    q, scale, offset = gguf_blocks.AFFINE[kind](torch.from_numpy(raw))
    w = AffineInt8(q.to(torch.int8), scale, offset, 32)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert int(q.max()) == 31 and np.array_equal(dequantize(w.q, w.scale, w.offset, 32).numpy(), want)
    fine = w.regroup(16, "test")
    assert np.array_equal(dequantize(fine.q, fine.scale, fine.offset, 16).numpy(), want)


@pytest.mark.parametrize("backend", ["cpu_q8", "dequant"])
def test_affine_int8_method_is_batch_invariant(backend: str) -> None:
    """Both backends equal x @ w^T on the dequantized Q5_K weight to float32 rounding; with the C
    kernels a row's output is the same bits alone or in a batch of 7 (the torch twin's F.linear
    makes no such promise, as for the other methods' twins)."""
    if backend == "cpu_q8":
        from stoker.kernels.cpu import build

        if not build.available():
            pytest.skip("the C kernels are not built")
    w = np.random.default_rng(5).normal(0, 0.1, size=(96, 512)).astype(np.float32)
    q, scale, offset = gguf_blocks.q5_k(torch.from_numpy(quantize_k_affine(w, 5)))
    layer = MergedLinear(512, {"a": 40, "b": 56}, bias=True)
    layer.attach(AffineInt8LinearMethod(16, backend))
    for shard, rows in (("a", slice(0, 40)), ("b", slice(40, 96))):
        layer.method.load_affine(layer, shard, AffineInt8(q[rows].to(torch.int8), scale[rows], offset[rows], 32))
    bias = torch.randn(96)
    layer.method.load(layer, "bias", None, bias)
    layer.method.process_after_loading(layer)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(1))
    batch = layer(x)
    for i in range(7 if backend == "cpu_q8" else 0):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])
    want = x @ dequantize(q, scale, offset, 32).T + bias
    torch.testing.assert_close(batch, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q3_K", "Q2_K", "IQ4_NL"])
def test_types_without_an_exact_method_refused_by_name(kind: str) -> None:
    from stoker.quantization.gguf import check_type

    with pytest.raises(QuantizationError, match=rf"GGUF tensor blk\.1\.ffn_up\.weight is {kind}, which has no exact"):
        check_type("blk.1.ffn_up.weight", kind)
