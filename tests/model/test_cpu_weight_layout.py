"""On CPU the runner re-lays projection weights column-major (layers/linear.py:
use_column_major_weights); the shapes, the tied LM head and the outputs stay as they were."""

from __future__ import annotations

import torch

from stoker import LLM, SamplingParams
from stoker.layers.embedding import LMHead, VocabEmbedding
from stoker.layers.linear import Linear, use_column_major_weights


def test_projection_weights_are_column_major_on_cpu(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints("llama", tie_word_embeddings=True)), kv_cache_memory_bytes=4 << 20, device="cpu")
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears
    for m in linears:
        out_features, in_features = m.weight.shape
        assert (out_features, in_features) == (m.out_features, m.in_features)
        assert m.weight.stride() == (1, out_features), "projection weight should be (in, out) in memory"
    embedding = next(m for m in model.modules() if isinstance(m, VocabEmbedding))
    lm_head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert lm_head.weight is embedding.weight and embedding.weight.is_contiguous()


def test_layout_does_not_change_outputs(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=4 << 20, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": list(range(30, 70))}
    laid_out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    model = llm.engine.runner.model
    for m in model.modules():  # back to row-major, as loaded
        if isinstance(m, (Linear, LMHead)) and not m.weight.is_contiguous():
            m.weight.data = m.weight.data.contiguous()
    llm.reset_prefix_cache()
    row_major = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert laid_out.token_ids == row_major.token_ids
    for a, b in zip(laid_out.logprobs, row_major.logprobs):
        for tok in a:
            torch.testing.assert_close(torch.tensor(a[tok].logprob), torch.tensor(b[tok].logprob), rtol=1e-5, atol=1e-5)
    assert use_column_major_weights(model) > 0  # and it can be applied again
