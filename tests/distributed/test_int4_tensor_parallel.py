"""Tensor parallelism with int4 weights on CPU over gloo (as test_tensor_parallel.py).

--quantization int4 quantizes each rank's part as it is read; every cut is at a group
boundary, so each rank's groups are TP=1's groups and its codes, scales and offsets are TP=1's
bits: TP=2 must give TP=1's greedy tokens. A cut that splits a group is refused, naming the
layer and the sizes."""

from __future__ import annotations

import pytest

from stoker import LLM
from tests.distributed.test_tensor_parallel import GREEDY, KV, engine, run

# o_proj's 256 input columns and down_proj's 512 split into whole groups of 128 at TP=2
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_int4_greedy_equals_tp1(tiny_checkpoints, arch: str) -> None:
    path = tiny_checkpoints(arch, **WIDE)
    with engine(path, quantization="int4") as llm:
        want = run(llm, GREEDY)
        whole = llm.engine.executor.driver_runner.weight_bytes_held()
    with engine(path, quantization="int4", tensor_parallel_size=2) as llm:
        assert run(llm, GREEDY) == want
        assert llm.engine.executor.driver_runner.weight_bytes_held() < 0.75 * whole  # each rank its shard


def test_a_tp_cut_that_splits_a_group_is_refused_by_layer(tiny_checkpoints) -> None:
    path = tiny_checkpoints("llama", hidden_size=128, intermediate_size=256)  # o_proj: 128 columns, 64 per rank
    with pytest.raises(Exception, match=r"o_proj: 64 input columns \(tensor parallelism gives this rank columns \[0, 64\) of 128\) "
                                        "are not whole int4 groups of 128"):
        LLM(str(path), kv_cache_memory_bytes=KV, max_model_len=256, device="cpu", quantization="int4", tensor_parallel_size=2)
