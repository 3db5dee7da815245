"""A GGUF file under tensor parallelism on CPU over gloo: each rank reads its rows and columns
of the decoded blocks (q/k rows un-permuted first, Q8_0 scales repeated to a merged layer's
groups of 16, a tied LM head from token_embd's blocks split by vocabulary rows; Q4_0 / Q4_K
through the int4 method, cut at groups of 32), and TP=2
gives TP=1's greedy tokens."""

from __future__ import annotations

from stoker import SamplingParams
from stoker.layers.quantized_method import QuantizedLinearMethod
from stoker.testing.gguf_checkpoint import write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer
from tests.distributed.test_tensor_parallel import engine, run

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WIDE = dict(hidden_size=256, intermediate_size=256)


# Llama (q/k permuted in the file), v and down in Q6_K beside Q8_0 (merged q/k/v at groups of 16),
# the output tied to a Q8_0 token_embd (the LM head's int8 blocks split by vocabulary rows)
ARCH, OVERRIDES = "llama", {"tie_word_embeddings": True}
TYPES = {r"v_proj\.weight|down_proj": "Q6_K", r"proj\.weight|embed_tokens": "Q8_0"}


def test_gguf_tp2_greedy_equals_tp1(tiny_checkpoints, tmp_path) -> None:
    path = write_gguf(tiny_checkpoints(ARCH, **WIDE, **OVERRIDES), tmp_path / "m.gguf", TYPES, ARCH)
    copy_demo_tokenizer(tmp_path)
    with engine(path) as llm:
        want = run(llm, GREEDY)
    with engine(path, tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        rank0 = llm.engine.executor.driver_runner
        assert rank0.tp.world_size == 2
        assert isinstance(rank0.model.get_submodule("lm_head").method, QuantizedLinearMethod)


# Q4_0 and Q4_K projections (int4, each rank's rows and whole groups of 32 columns of the decoded
# tensors, q/k rows un-permuted first), the output tied to a Q4_0 token_embd (an int4 LM head
# split by vocabulary rows)
Q4_TYPES = {r"q_proj|v_proj|o_proj|up_proj": "Q4_0", r"proj\.weight": "Q4_K", r"embed_tokens": "Q4_0"}


def test_gguf_q4_tp2_greedy_equals_tp1(tiny_checkpoints, tmp_path) -> None:
    from stoker.layers.int4_method import Int4LinearMethod

    path = write_gguf(tiny_checkpoints(ARCH, **WIDE, **OVERRIDES), tmp_path / "m.gguf", Q4_TYPES, ARCH)
    copy_demo_tokenizer(tmp_path)
    with engine(path) as llm:
        want = run(llm, GREEDY)
    with engine(path, tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        model = llm.engine.executor.driver_runner.model
        for name in ("lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"):
            assert isinstance(model.get_submodule(name).method, Int4LinearMethod), name


def test_gguf_q4_k_m_mix_tp2_greedy_equals_tp1(tiny_checkpoints, tmp_path) -> None:
    """llama.cpp's Q4_K_M mix (stoker/testing/gguf_checkpoint.llama_cpp_types): layer 1's q/k/v
    is Q4_K q/k beside a Q6_K v (a composite layer: each run's shards cut by heads, groups whole),
    its down Q6_K; a Q5_K_M-style Q5_K o_proj (affine int8) cut at groups of 32 columns."""
    from stoker.layers.composite_method import CompositeLinearMethod
    from stoker.layers.int8_affine_method import AffineInt8LinearMethod
    from stoker.testing.gguf_checkpoint import llama_cpp_types

    types = {r"layers\.1\.self_attn\.o_proj": "Q5_K", **llama_cpp_types("Q4_K_M", 2, tied=True)}
    path = write_gguf(tiny_checkpoints(ARCH, **WIDE, **OVERRIDES), tmp_path / "m.gguf", types, ARCH)
    copy_demo_tokenizer(tmp_path)
    with engine(path) as llm:
        want = run(llm, GREEDY)
    with engine(path, tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        model = llm.engine.executor.driver_runner.model
        assert isinstance(model.get_submodule("model.layers.1.self_attn.qkv_proj").method, CompositeLinearMethod)
        assert isinstance(model.get_submodule("model.layers.1.self_attn.o_proj").method, AffineInt8LinearMethod)


def test_gguf_moe_q4_experts_tp2_greedy_equals_tp1(tiny_checkpoints, tmp_path) -> None:
    """Mixtral with Q4_K w1/w3 and Q4_0 w2 experts (the int4 MoE method, layout gguf): each rank
    reads its rows of gate and up and its whole groups of 32 columns of down, scales and offsets
    with them."""
    from stoker.layers.moe import FusedMoE
    from stoker.layers.moe_int4 import Int4MoEMethod

    src = tiny_checkpoints("mixtral", hidden_size=256, num_local_experts=4, num_experts_per_tok=2, intermediate_size=256)
    types = {r"experts\.\d+\.w2": "Q4_0", r"experts": "Q4_K", r"proj\.weight": "Q8_0"}
    path = write_gguf(src, tmp_path / "m.gguf", types, "llama")
    copy_demo_tokenizer(tmp_path)
    with engine(path) as llm:
        want = run(llm, GREEDY)
    with engine(path, tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        moes = [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(isinstance(m.method, Int4MoEMethod) and m.is_split for m in moes)


def test_gguf_moe_q4_k_m_tp2_greedy_equals_tp1(tiny_checkpoints, tmp_path) -> None:
    """Qwen3-MoE in llama-quantize's Q4_K_M mix over 4 layers (stoker/testing/gguf_checkpoint.
    llama_cpp_types): layers 2-3 hold Q4_K gate/up beside a Q6_K down per projection
    (layers/moe_mixed.py); each rank reads its rows of gate and up and its whole groups of 16
    columns of the int8 down, scales and offsets with them."""
    from stoker.layers.moe import FusedMoE
    from stoker.layers.moe_mixed import MixedMoEMethod
    from stoker.testing.gguf_checkpoint import llama_cpp_types

    src = tiny_checkpoints("qwen3_moe", hidden_size=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                           head_dim=64, norm_topk_prob=True, num_hidden_layers=4)
    path = write_gguf(src, tmp_path / "m.gguf", llama_cpp_types("Q4_K_M", 4), "qwen3moe")
    copy_demo_tokenizer(tmp_path)
    with engine(path) as llm:
        want = run(llm, GREEDY)
    with engine(path, tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        moes = [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, FusedMoE)]
        mixed = [m for m in moes if isinstance(m.method, MixedMoEMethod)]
        assert len(mixed) == 2 and all(m.is_split and m.method.group["w2"] == 16 for m in mixed)
