"""Multi-head latent attention under tensor and expert parallelism on CPU over gloo: the heads
are split (q / q_b column-parallel, o row-parallel, kv_b read per rank's heads), the latent
replicated (every rank caches all kv_lora_rank + qk_rope_head_dim values per token); a TP=2
engine gives TP=1's tokens, for DeepSeek-V3 (q LoRA) and V2-Lite (plain q_proj). With
--enable-expert-parallel each rank holds half of every MoE layer's routed experts, whole, and
the shared experts stay cut over the ranks; EP=2 gives TP=1's tokens too."""

from __future__ import annotations

import pytest

from tests.distributed.test_tensor_parallel import GREEDY, engine, run
from tests.model.test_mla import CONFIGS


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2-lite"])
def test_mla_tp2_greedy_equals_tp1(tiny_checkpoints, name: str) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    with engine(path) as llm:
        want = run(llm, GREEDY)
        latent_bytes = llm.engine.executor.driver_runner.kv_spec.bytes_per_token
    with engine(path, tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        runner = llm.engine.executor.driver_runner
        assert runner.kv_spec.bytes_per_token == latent_bytes  # replicated, not split
        assert all(layer.self_attn.num_heads == 2 for layer in runner.model.model.layers)  # 4 heads over 2 ranks
    with engine(path, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        assert run(llm, GREEDY) == want
        layers = llm.engine.executor.driver_runner.model.model.layers
        sparse = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
        assert len(sparse) == overrides["num_hidden_layers"] - overrides["first_k_dense_replace"]
        inter = overrides["moe_intermediate_size"]
        for block in sparse:  # rank 0: routed experts 0..3 of 8, whole; the shared experts cut in two
            experts = block.experts
            assert (experts.num_experts, experts.global_num_experts, experts.expert_split.start) == (4, 8, 0)
            assert experts.w13.shape[0] == 4 and experts.intermediate_size == inter
            assert block.shared_experts.down_proj.in_features == overrides["n_shared_experts"] * inter // 2


def test_block_fp8_v3_ep2_equals_tp1(tiny_checkpoints, tmp_path) -> None:
    """DeepSeek's release format (every projection and expert e4m3 in 128 x 128 blocks with
    weight_scale_inv) under expert parallelism: each rank reads its experts' blocks and scales.
    The shapes keep every tensor-parallel cut on whole 128-blocks, as V3's do (the heads' q_b
    and o_proj parts, the dense and shared MLPs' halves); a cut inside a block is refused."""
    from stoker.testing.quantized_checkpoint import quantize_checkpoint

    arch, overrides = CONFIGS["deepseek_v3"]
    overrides = dict(overrides, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, intermediate_size=256,
                     moe_intermediate_size=128)  # 4 heads x 64 = 256 q_b rows, 2 shared x 128 = 256
    path = quantize_checkpoint(tiny_checkpoints(arch, **overrides), tmp_path / "fp8", "fp8-block")
    with engine(path) as llm:
        want = run(llm, GREEDY)
    with engine(path, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        assert run(llm, GREEDY) == want
