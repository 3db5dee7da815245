"""A request's tokens and logprobs on a MoE model do not depend on what it is batched with
(issue 12, as tests/model/test_batch_invariance.py for the dense families): the router and the
experts run on the C kernels' panels (each output one in-order sum whatever the rows), and each
token's k expert outputs are added in ascending expert order (layers/moe.py)."""

from __future__ import annotations

import random

import pytest

from stoker import LLM, SamplingParams
from stoker.kernels.cpu import build
from tests.model.test_batch_invariance import PROMPT_LEN, _mixed_batch

pytestmark = pytest.mark.skipif(
    not build.available(),
    reason="batch invariance is a property of the C kernels; the torch/MKL fallback does not promise it",
)

CONFIGS = {
    # I = 32 fills whole AVX-512 panels (SiLU fused into the gate/up kernel); 40 does not
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                    norm_topk_prob=True)),
    "qwen2_moe-shared": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                           shared_expert_intermediate_size=48)),
    # the grouped sigmoid router with its correction bias, ungated shared experts, half-head rotary
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                  moe_intermediate_size=32, routed_scaling_factor=2.5, use_qk_norm=True,
                                  attention_bias=True, head_dim=32)),
    # expert biases and the clamped SwiGLU in the one C call, sinks, sliding and full layers
    "gpt_oss": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=32,
                                sliding_window=24, swiglu_limit=1.0)),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def llm(request, tiny_checkpoints) -> LLM:
    arch, overrides = CONFIGS[request.param]
    ckpt = tiny_checkpoints(arch, hidden_size=128, vocab_size=1000, num_attention_heads=4, num_key_value_heads=2,
                            **overrides)
    return LLM(str(ckpt), max_model_len=512, max_num_batched_tokens=96, kv_cache_memory_bytes=32 << 20)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_k=50, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2),
    ],
    ids=["greedy", "seeded"],
)
def test_same_tokens_alone_and_in_a_batch_of_32(llm: LLM, params: SamplingParams) -> None:
    rng = random.Random(7)
    target = [rng.randrange(5, 1000) for _ in range(PROMPT_LEN)]
    llm.engine.reset_prefix_cache()
    alone = llm.generate([{"prompt_token_ids": target}], params, use_tqdm=False)[0].outputs[0]
    llm.engine.reset_prefix_cache()
    prompts, sampling, where = _mixed_batch(rng, target, params)
    batched = llm.generate(prompts, sampling, use_tqdm=False)[where].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs, "same tokens, but the logprobs differ: a batch-dependent sum"
    llm.engine.check_integrity()
