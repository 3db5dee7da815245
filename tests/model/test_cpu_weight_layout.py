"""On CPU the runner changes the projection weights' memory layout after loading
(layers/linear.py): packed panels for the C linear kernel when the CPU kernels are built,
else column-major for MKL. The tied LM head and the outputs stay as they were."""

from __future__ import annotations

import shutil

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.embedding import LMHead, VocabEmbedding
from stoker.layers.linear import Linear, MergedLinear, use_column_major_weights

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler: the CPU kernels are not built"
)


def _generate(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(30, 70))}, {"prompt_token_ids": list(range(5, 12))}]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_compiler
def test_projection_weights_are_packed_when_the_kernels_are_built(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints("llama", tie_word_embeddings=True)), kv_cache_memory_bytes=4 << 20, device="cpu")
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears
    for m in linears:
        assert m.packed and m.weight.dim() == 3 and m.weight.shape[1] == m.in_features
        assert m.weight.shape[0] * m.weight.shape[2] >= m.out_features
    embedding = next(m for m in model.modules() if isinstance(m, VocabEmbedding))
    lm_head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert not lm_head.packed and lm_head.weight is embedding.weight and embedding.weight.is_contiguous()
    mlps = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert mlps and all(m.gate_up_proj.fused_silu_and_mul for m in mlps), "SiLU should be fused into gate_up"
    merged = next(m for m in linears if isinstance(m, MergedLinear))
    with pytest.raises(RuntimeError, match="before pack_cpu_weights"):
        merged.load_shard("weight", "q", torch.zeros(1))
    assert use_column_major_weights(model) == 0  # packed weights are left alone


def test_projection_weights_are_column_major_without_the_kernels(tiny_checkpoints, monkeypatch) -> None:
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    llm = LLM(str(tiny_checkpoints("llama", tie_word_embeddings=False)), kv_cache_memory_bytes=4 << 20, device="cpu")
    model = llm.engine.runner.model
    for m in model.modules():
        if isinstance(m, (Linear, LMHead)):
            out_features, in_features = m.weight.shape
            assert not m.packed and (out_features, in_features) == (m.out_features, m.in_features)
            assert m.weight.stride() == (1, out_features), "projection weight should be (in, out) in memory"


@needs_compiler
@pytest.mark.parametrize("intermediate_size", [128, 72])  # 72: not whole panels, SiLU stays apart
def test_layouts_do_not_change_outputs(tiny_checkpoints, monkeypatch, intermediate_size: int) -> None:
    """Packed (C kernel), column-major (MKL) and the packed weights through the torch twin
    (kernels switched off after packing) give the same tokens and logprobs."""
    path = str(tiny_checkpoints("qwen2", tie_word_embeddings=False, intermediate_size=intermediate_size))
    packed_llm = LLM(path, kv_cache_memory_bytes=4 << 20, device="cpu")
    model = packed_llm.engine.runner.model
    assert next(m for m in model.modules() if isinstance(m, LMHead)).packed
    fused = [m.gate_up_proj.fused_silu_and_mul for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert fused and all(fused) == (intermediate_size == 128)
    packed = _generate(packed_llm)
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    packed_llm.reset_prefix_cache()
    twin = _generate(packed_llm)
    column_major = _generate(LLM(path, kv_cache_memory_bytes=4 << 20, device="cpu"))
    for other in (twin, column_major):
        for a, b in zip(packed, other):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                for tok in x:
                    torch.testing.assert_close(torch.tensor(x[tok].logprob), torch.tensor(y[tok].logprob), rtol=1e-4, atol=1e-4)
