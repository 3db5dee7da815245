"""Each projection's weight method is chosen once, when the model is built (models/method_chooser.py):
packed panels for the C linear kernel on CPU when the kernels are built, else column-major
for MKL; the tied LM head shares the embedding. Every layout gives the same outputs."""

from __future__ import annotations

import shutil

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.kernels import ops, reference
from stoker.layers.embedding import LMHead, VocabEmbedding
from stoker.layers.linear import Linear, MergedLinear
from stoker.layers.weight_method import ColumnMajorMethod, PackedCpuMethod, TiedMethod

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
    model = llm.engine.executor.driver_runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and not isinstance(m, LMHead)]
    assert linears
    for m in linears:
        assert isinstance(m.method, PackedCpuMethod)
        assert m.weight.dim() == 3 and m.weight.shape[1] == m.in_features
        assert m.weight.shape[0] * m.weight.shape[2] >= m.out_features
    embedding = next(m for m in model.modules() if isinstance(m, VocabEmbedding))
    lm_head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert isinstance(lm_head.method, TiedMethod)
    assert lm_head.weight is embedding.weight and embedding.weight.is_contiguous()
    mlps = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert mlps and all(m.gate_up_proj.method.fuse_silu_and_mul for m in mlps), "SiLU should be fused into gate_up"
    merged = next(m for m in linears if isinstance(m, MergedLinear))
    with pytest.raises(RuntimeError, match="chosen once"):
        merged.attach(ColumnMajorMethod())


def test_projection_weights_are_column_major_without_the_kernels(tiny_checkpoints, monkeypatch) -> None:
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    llm = LLM(str(tiny_checkpoints("llama", tie_word_embeddings=False)), kv_cache_memory_bytes=4 << 20, device="cpu")
    model = llm.engine.executor.driver_runner.model
    for m in model.modules():
        if isinstance(m, Linear):
            assert isinstance(m.method, ColumnMajorMethod)
            out_features, in_features = m.weight.shape
            assert (out_features, in_features) == (m.out_features, m.in_features)
            assert m.weight.stride() == (1, out_features), "projection weight should be (in, out) in memory"


def test_the_backend_is_not_re_read_per_call(tiny_checkpoints, monkeypatch) -> None:
    """The environment picks the backend at build; flipping it later changes nothing."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    llm = LLM(str(tiny_checkpoints("llama")), kv_cache_memory_bytes=4 << 20, device="cpu")
    before = _generate(llm)
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    llm.reset_prefix_cache()
    model = llm.engine.executor.driver_runner.model
    methods = {type(m.method) for m in model.modules() if isinstance(m, Linear) and not isinstance(m, LMHead)}
    assert methods == {PackedCpuMethod}
    # Attention, norms, rotary and the gated activation hold the C kernel set they were built with.
    sets = {m.kernels.name for m in model.modules() if isinstance(getattr(m, "kernels", None), ops.Kernels)}
    assert sets == {"cpu"}
    after = _generate(llm)
    assert [a.token_ids for a in after] == [b.token_ids for b in before]


def test_layers_without_the_c_kernels_get_the_torch_twins(tiny_checkpoints, monkeypatch) -> None:
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    llm = LLM(str(tiny_checkpoints("qwen3")), kv_cache_memory_bytes=4 << 20, device="cpu")
    model = llm.engine.executor.driver_runner.model
    kinds = {type(m).__name__: m.kernels.name for m in model.modules() if isinstance(getattr(m, "kernels", None), ops.Kernels)}
    assert kinds == {"Attention": "torch", "RMSNorm": "torch", "RotaryEmbedding": "torch", "SiluAndMul": "torch"}


@needs_compiler
@pytest.mark.parametrize("intermediate_size", [128, 72])  # 72: not whole panels, SiLU stays apart
def test_layouts_do_not_change_outputs(tiny_checkpoints, monkeypatch, intermediate_size: int) -> None:
    """Packed (C kernel), column-major (MKL) and the packed weights through the torch twin
    give the same tokens and logprobs."""
    path = str(tiny_checkpoints("qwen2", tie_word_embeddings=False, intermediate_size=intermediate_size))
    packed_llm = LLM(path, kv_cache_memory_bytes=4 << 20, device="cpu")
    model = packed_llm.engine.executor.driver_runner.model
    assert isinstance(next(m for m in model.modules() if isinstance(m, LMHead)).method, PackedCpuMethod)
    fused = [m.gate_up_proj.method.fuse_silu_and_mul for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert fused and all(fused) == (intermediate_size == 128)
    packed = _generate(packed_llm)
    for m in model.modules():  # the same panels through the twin
        if isinstance(m, Linear):
            m.method.kernel = reference.linear_packed
    packed_llm.reset_prefix_cache()
    twin = _generate(packed_llm)
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    column_major = _generate(LLM(path, kv_cache_memory_bytes=4 << 20, device="cpu"))
    for other in (twin, column_major):
        for a, b in zip(packed, other):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                for tok in x:
                    torch.testing.assert_close(torch.tensor(x[tok].logprob), torch.tensor(y[tok].logprob), rtol=1e-4, atol=1e-4)
