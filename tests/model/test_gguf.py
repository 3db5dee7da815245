"""GGUF files (written by the test with the `gguf` package, laid out as llama.cpp's converter
writes them: stoker/testing/gguf_checkpoint.py) load and compute what HF transformers computes
on the weights the file stands for (dequantized by `gguf.quants.dequantize`): prefill logits to
float32 tolerance and greedy tokens over 32 steps, for Llama (q/k rows permuted in the file),
Qwen2 (biases, embeddings tied to a quantized token_embd) and Qwen3 (q/k norms, head_dim != hidden
/ heads), with types mixed per tensor as real files mix them. Block decoders are bit-exact against
gguf's; types with no exact method are refused by name.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.embedding import LMHead
from stoker.layers.linear import Linear
from stoker.layers.quantized_method import QuantizedLinearMethod
from stoker.models.gguf_names import hf_name, permute_rows, unpermute_rows
from stoker.models.loader import read_hf_config
from stoker.quantization import gguf_blocks
from stoker.quantization.config import QuantizationError
from stoker.testing.gguf_checkpoint import quantize_q6_k, write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

# K-quants need rows of whole 256-value super-blocks: hidden and intermediate multiples of 256.
WIDE = dict(hidden_size=256, intermediate_size=256)
PROMPTS = [[0] + list(range(7, 70)), [0, 99, 5, 17, 256, 800, 3]]
# Per family: config overrides and the type of each tensor (regex over HF names, first match;
# unmatched tensors are F32), mixed as Q4_K_M / Q8_0 files mix them.
CASES = {
    # v and down in Q6_K beside Q8_0 q/k and gate/up: the merged q/k/v runs at groups of 16
    "llama": ({}, {r"v_proj\.weight|down_proj": "Q6_K", r"proj\.weight|embed_tokens|lm_head": "Q8_0"}),
    # tied embeddings: the file has no output.weight, so the LM head is token_embd's Q8_0 blocks
    # (and o_proj BF16)
    "qwen2": (dict(tie_word_embeddings=True), {r"o_proj": "BF16", r"proj\.weight": "Q6_K", r"embed_tokens": "Q8_0"}),
    # o_proj F16 (float beside quantized projections of other layers), norms F32 and F16
    "qwen3": (dict(head_dim=32), {r"o_proj": "F16", r"proj\.weight|lm_head": "Q8_0", r"embed_tokens|input_layernorm": "F16"}),
}


@pytest.fixture(scope="module")
def gguf_files(tiny_checkpoints, tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            overrides, types = CASES[arch]
            src = tiny_checkpoints(arch, **WIDE, **overrides)
            root = tmp_path_factory.mktemp(f"gguf-{arch}")
            (root / "file").mkdir()
            path = write_gguf(src, root / "file" / "model.gguf", types, arch, dequantized_dst=root / "deq")
            copy_demo_tokenizer(root / "file")  # the folder's HF tokenizer is used
            cache[arch] = (path, root / "deq")
        return cache[arch]

    return get


def _linears(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.executor.driver_runner.model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_file_matches_hf_on_dequantized_weights(arch: str, gguf_files) -> None:
    path, deq = gguf_files(arch)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20, device="cpu")
    linears = _linears(llm)
    if arch == "llama":
        qkv, o = linears["model.layers.0.self_attn.qkv_proj"].method, linears["model.layers.0.self_attn.o_proj"].method
        assert isinstance(qkv, QuantizedLinearMethod) and qkv.group_k == 16 and o.group_k == 32
        assert linears["model.layers.0.mlp.down_proj"].method.group_k == 16
    if arch == "qwen2":
        head = linears["lm_head"]
        assert isinstance(head, LMHead) and head.tied_embedding is None and isinstance(head.method, QuantizedLinearMethod)
    if arch == "qwen3":
        assert not isinstance(linears["model.layers.1.self_attn.o_proj"].method, QuantizedLinearMethod)
        assert isinstance(linears["model.layers.1.mlp.gate_up_proj"].method, QuantizedLinearMethod)
    hf = load_hf(deq)
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("kind", list(gguf_blocks.BLOCK_BYTES))
def test_block_decoders_equal_gguf_dequantize(kind: str) -> None:
    """Random blocks (finite fp16 scales): the decoded form expanded equals gguf's dequantize
    bit for bit, and has the shapes the methods hold."""
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(6, 3, gguf_blocks.BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208]}[kind]:
        raw[..., at:at + 2] = rng.normal(0, 0.01, size=(6, 3, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(6, -1)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    t = torch.from_numpy(raw)
    assert np.array_equal(gguf_blocks.dequantize(t, kind).numpy(), expected)
    k, g = expected.shape[1], gguf_blocks.GROUP_K[kind]
    if kind in gguf_blocks.SYMMETRIC:
        q, scale = gguf_blocks.SYMMETRIC[kind](t)
        assert q.dtype == torch.int8 and q.shape == (6, k) and scale.shape == (6, k // g)
    else:
        q, scale, offset = gguf_blocks.AFFINE[kind](t)
        assert q.dtype == torch.uint8 and q.shape == (6, k) and scale.shape == offset.shape == (6, k // g)
        assert int(q.max()) <= (31 if kind in ("Q5_K", "Q5_1") else 15)


def test_q6_k_groups_of_16_through_the_gpu_kernel() -> None:
    """On CUDA a Q6_K projection runs the Triton weight-only GEMM at group_k 16 (its smallest
    tile): interpreted here, against the twin, on decoded Q6_K blocks."""
    pytest.importorskip("triton")
    from stoker.kernels import reference
    from stoker.kernels.w8_linear import w8_linear

    w = np.random.default_rng(3).normal(0, 0.1, size=(70, 512)).astype(np.float32)
    q, scale = gguf_blocks.q6_k(torch.from_numpy(quantize_q6_k(w)))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    out, ref = w8_linear(x, q, scale, 16, None), reference.w8_linear(x, q, scale, 16, None)
    assert float((out - ref).norm() / ref.norm()) < 1e-6


def test_q6_k_writer_round_trips() -> None:
    """The test's Q6_K blocks are what ggml reads: gguf's dequantize gives back the weights to
    within half a step of each sub-block."""
    w = np.random.default_rng(2).normal(0, 0.1, size=(8, 512)).astype(np.float32)
    deq = gguf.quants.dequantize(quantize_q6_k(w), gguf.GGMLQuantizationType.Q6_K)
    step = np.abs(w.reshape(8, -1, 16)).max(axis=-1, keepdims=True) / 31
    assert (np.abs(deq - w).reshape(8, -1, 16) <= 0.6 * step + 1e-7).all()


def test_llama_file_reads_the_same_in_transformers(gguf_files) -> None:
    """transformers' own GGUF loader (its reverse of llama.cpp's q/k permutation, written
    against llama.cpp's files) reads the test's llama file as the dequantized checkpoint: the
    writer lays rows out as llama.cpp does, not merely as Stoker's loader expects."""
    import transformers

    path, deq = gguf_files("llama")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = PROMPTS[0]
    torch.testing.assert_close(hf_logits(theirs.eval(), ids), hf_logits(load_hf(deq), ids), rtol=0, atol=1e-5)


def test_qk_permutation_round_trip() -> None:
    """llama.cpp interleaves each head's rotary halves: rows [a0 a1 b0 b1] of a head_dim-4 head
    become [a0 b0 a1 b1]; unpermute_rows undoes it for weights and per-row scales alike."""
    rows = torch.arange(16).reshape(8, 2)  # 2 heads of head_dim 4
    permuted = permute_rows(rows, 2)
    assert permuted[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]
    assert torch.equal(unpermute_rows(permuted, 2), rows)
    w = torch.randn(4 * 32, 7)
    assert torch.equal(unpermute_rows(permute_rows(w, 4), 4), w)


def test_tensor_names() -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_name("blk.0.ssm_a")


@pytest.mark.parametrize("kind", ["Q3_K", "Q2_K"])
def test_unsupported_types_refused_by_name(kind: str, tiny_checkpoints, tmp_path) -> None:
    src = tiny_checkpoints("llama", **WIDE)
    path = write_gguf(src, tmp_path / "m.gguf", {r"layers\.1\.mlp\.up_proj": kind, r"proj\.weight": "Q8_0"}, "llama")
    with pytest.raises(QuantizationError, match=rf"GGUF tensor blk\.1\.ffn_up\.weight is {kind}"):
        LLM(str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20, device="cpu")


def test_float_beside_quantized_shard(tiny_checkpoints, tmp_path) -> None:
    """q/k/v are one layer in Stoker: an F16 q beside Q8_0 k/v runs as two runs of shards (a
    float GEMM and an int8 one, layers/composite_method.py) and computes what HF does."""
    from stoker.layers.composite_method import CompositeLinearMethod

    src = tiny_checkpoints("llama", **WIDE)
    path = write_gguf(src, tmp_path / "m.gguf", {r"layers\.0\.self_attn\.q_proj": "F16", r"proj\.weight": "Q8_0"}, "llama",
                      dequantized_dst=tmp_path / "deq")
    copy_demo_tokenizer(tmp_path)
    llm = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=1 << 20, device="cpu")
    method = _linears(llm)["model.layers.0.self_attn.qkv_proj"].method
    assert isinstance(method, CompositeLinearMethod) and [s for s, _ in method.runs] == [("q",), ("k", "v")]
    torch.testing.assert_close(engine_logits(llm, PROMPTS[1]), hf_logits(load_hf(tmp_path / "deq"), PROMPTS[1]),
                               rtol=1e-4, atol=1e-4)


def test_config_from_metadata(gguf_files) -> None:
    cfg = read_hf_config(gguf_files("qwen3")[0])
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (256, 2, 4, 2, 32, 256, 1024)
    assert cfg["rms_norm_eps"] == pytest.approx(1e-6) and cfg["max_position_embeddings"] == 1024
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == 4
    assert read_hf_config(gguf_files("qwen2")[0])["quantization_config"]["tensors"]["lm_head"] == ["token_embd.weight", "Q8_0"]


def test_tokenizer_and_chat_template_from_the_file(tiny_checkpoints, tmp_path) -> None:
    """No tokenizer files beside the .gguf: the file's vocabulary (transformers' GGUF tokenizer,
    offline) encodes as the HF tokenizer does, and its chat template is the file's."""
    from stoker.engine.tokenizer import load_tokenizer

    src = tiny_checkpoints("llama", **WIDE)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|eot_id|>{% endfor %}"
    path = write_gguf(src, tmp_path / "m.gguf", {r"proj\.weight": "Q8_0"}, "llama", chat_template=template)
    tok, ref = load_tokenizer(path), load_tokenizer(src)
    for text in ["Hello world, a stoker feeds the furnace.", "  two spaces\nand lines", "<|eot_id|>x"]:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.eos_token_id == 4 and read_hf_config(path)["eos_token_id"] == 4
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "[user] hi<|eot_id|>"


def test_stoker_serve_takes_a_gguf_file(gguf_files) -> None:
    """`stoker serve model.gguf` as a user runs it: the argument parses, the app serves a completion."""
    from openai import OpenAI

    from stoker.cli import build_parser
    from stoker.server.cli import build_app
    from tests.server.conftest import serve_app

    path = gguf_files("llama")[0]
    args = build_parser().parse_args(["serve", str(path), "--max-model-len", "128", "--kv-cache-memory-bytes",
                                      str(4 << 20), "--log-interval", "3600", "--served-model-name", "tiny-gguf"])
    app, settings = build_app(args)
    assert settings.model_path == str(path)
    live = serve_app(app)
    try:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny-gguf", prompt="a stoker", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    finally:
        live.stop()
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        build_app(build_parser().parse_args(["serve", str(path.parent / "missing.gguf")]))


def test_quantization_flag_refused(gguf_files) -> None:
    with pytest.raises(QuantizationError, match="GGUF file is already quantized"):
        LLM(str(gguf_files("llama")[0]), max_model_len=64, kv_cache_memory_bytes=1 << 20, device="cpu", quantization="int8")


def test_vocab_tokenizer_converted_once_and_copied(tiny_checkpoints, tmp_path) -> None:
    """Each caller (the server loads one per thread) gets its own tokenizer; the conversion from
    the file's metadata runs once."""
    from stoker.engine import tokenizer as tokenizers

    path = write_gguf(tiny_checkpoints("llama", **WIDE), tmp_path / "m.gguf", {r"proj\.weight": "Q8_0"}, "llama")
    before = tokenizers._gguf_vocab_tokenizer.cache_info().misses
    a, b = tokenizers.load_tokenizer(path), tokenizers.load_tokenizer(path)
    assert a is not b and a.encode("a stoker") == b.encode("a stoker")
    assert tokenizers._gguf_vocab_tokenizer.cache_info().misses == before + 1


def test_float_file_with_tied_embeddings(tiny_checkpoints, tmp_path) -> None:
    """An F16 file (no quantized tensor: no quantization config) with the output tied to token_embd."""
    src = tiny_checkpoints("qwen2", tie_word_embeddings=True)
    (tmp_path / "f").mkdir()
    path = write_gguf(src, tmp_path / "f" / "m.gguf", {r"weight": "F16"}, "qwen2", dequantized_dst=tmp_path / "deq")
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20, device="cpu")
    runner = llm.engine.executor.driver_runner
    assert runner.quant is None and runner.model.config["tie_word_embeddings"] is True
    ids = PROMPTS[1]
    torch.testing.assert_close(engine_logits(llm, ids), hf_logits(load_hf(tmp_path / "deq"), ids), rtol=1e-4, atol=1e-4)


def test_mistral_written_as_llama(tiny_checkpoints, tmp_path) -> None:
    """llama.cpp's converter writes Mistral as the llama architecture (q/k permuted): it runs as
    Llama and matches HF's Mistral on the dequantized weights."""
    src = tiny_checkpoints("mistral")
    (tmp_path / "f").mkdir()
    path = write_gguf(src, tmp_path / "f" / "m.gguf", {r"proj\.weight|lm_head|embed": "Q8_0"}, "llama",
                      dequantized_dst=tmp_path / "deq")
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20, device="cpu")
    assert llm.engine.hf_config["architectures"] == ["LlamaForCausalLM"]
    hf = load_hf(tmp_path / "deq")
    assert type(hf).__name__ == "MistralForCausalLM"
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


def test_models_yaml_takes_a_gguf_path(gguf_files, tmp_path) -> None:
    """`stoker serve --config models.yaml` with a .gguf path: a generative model; under pooling, refused."""
    from stoker.server.repository.model_config import ConfigError, load_serve_config

    path = gguf_files("llama")[0]
    good = tmp_path / "models.yaml"
    good.write_text(f"generate:\n  path: {path}\n  served_model_name: tiny-gguf\n")
    assert load_serve_config(good).generate.path == str(path)
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"generate:\n  path: {path.parent / 'nope.gguf'}\n")
    with pytest.raises(ConfigError, match="no such GGUF file"):
        load_serve_config(missing)
    pooling = tmp_path / "pooling.yaml"
    pooling.write_text(f"pooling:\n  - path: {path}\n")
    with pytest.raises(ConfigError, match="is a generate model"):
        load_serve_config(pooling)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_from_rope_freqs(tiny_checkpoints, tmp_path) -> None:
    """A Llama 3.1-style file carries its rope scaling only as rope_freqs.weight (head_dim / 2
    factors): the parameters come back exactly (head_dim 64, base 1e4: four dimensions between
    the two wavelength bounds) and the model matches HF with the original config."""
    src = tiny_checkpoints("llama", **WIDE, rope_parameters=LLAMA3_ROPE)
    (tmp_path / "f").mkdir()
    path = write_gguf(src, tmp_path / "f" / "m.gguf", {r"proj\.weight|lm_head|embed": "Q8_0"}, "llama",
                      dequantized_dst=tmp_path / "deq")
    cfg = read_hf_config(path)
    assert cfg["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=8 << 20, device="cpu")
    hf = load_hf(tmp_path / "deq")
    ids = [0] + list(range(7, 200))  # long enough for the scaled low frequencies to count
    torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)


def test_rope_freqs_that_match_no_llama3_scaling_refused() -> None:
    from stoker.models.gguf_rope import llama3_rope_scaling, rope_factors

    good = rope_factors(10000.0, 64, 8.0, 1.0, 4.0, 8192)
    assert llama3_rope_scaling(good, 10000.0, 64, None)["factor"] == 8.0
    bad = good.copy()
    bad[0] = 1.5  # a high-frequency dimension scaled: no llama3 parameters give it
    with pytest.raises(ValueError, match="rope_freqs.weight matches no Llama 3 rope scaling"):
        llama3_rope_scaling(bad, 10000.0, 64, None)
