"""Multi-head latent attention under tensor parallelism on CPU over gloo: the heads are split
(q / q_b column-parallel, o row-parallel, kv_b read per rank's heads), the latent replicated
(every rank caches all kv_lora_rank + qk_rope_head_dim values per token); a TP=2 engine gives
TP=1's tokens, for DeepSeek-V3 (q LoRA) and V2-Lite (plain q_proj)."""

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
