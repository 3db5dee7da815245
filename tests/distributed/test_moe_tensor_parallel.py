"""Mixture-of-Experts under tensor parallelism on CPU over gloo: each rank holds its columns of
every expert's I (and of the shared expert's), all-reduces its partial sum, and a TP=2 engine
gives TP=1's tokens; OLMoE's whole-projection q/k norm adds every rank's sums of squares."""

from __future__ import annotations

import pytest

from tests.distributed.test_tensor_parallel import GREEDY, engine, run


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16,
                           norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
        ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                           shared_expert_intermediate_size=40)),
        ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=24,
                          n_shared_experts=2, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                          head_dim=16)),
        # expert biases (w2's added once, by rank 0), the clamped SwiGLU, each rank's heads' sinks
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                         sliding_window=24, swiglu_limit=1.0)),
        # q/k RMSNorm over the whole projection: each rank adds the others' sums of squares
        ("olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    ],
    ids=["qwen3_moe", "mixtral", "qwen2_moe-shared", "glm4_moe", "gpt_oss", "olmoe-qknorm"],
)
def test_moe_tp2_greedy_equals_tp1(tiny_checkpoints, arch: str, overrides: dict) -> None:
    path = tiny_checkpoints(arch, **overrides)
    with engine(path) as llm:
        want = run(llm, GREEDY)
    with engine(path, tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        experts = [m for m in llm.engine.executor.driver_runner.model.modules() if type(m).__name__ == "FusedMoE"]
        assert experts and all(m.intermediate_size == m.checkpoint_intermediate_size // 2 for m in experts)
