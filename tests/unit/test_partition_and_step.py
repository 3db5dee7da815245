"""Tensor-parallel partitions and the step message (pure Python)."""

from __future__ import annotations

import pickle
import re

import pytest

from stoker.config import ParallelConfig
from stoker.core.block_manager import BlockManager
from stoker.core.scheduler import Scheduler
from stoker.core.sequence import Sequence
from stoker.core.step import build_step
from stoker.distributed.partition import Partition, kv_head_partition
from stoker.sampling_params import SamplingParams


def test_partitions_cover_the_dimension_once() -> None:
    assert [Partition(4, i).range(64) for i in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # a vocabulary no rank count divides: equal padded parts, the last one short
    parts = [Partition(2, i, padded=True) for i in range(2)]
    assert [p.range(1023) for p in parts] == [(0, 512), (512, 1023)] and parts[1].size(1023) == 512
    with pytest.raises(ValueError, match="equal parts"):
        Partition(3, 0).size(64)


def test_kv_heads_split_then_replicate() -> None:
    assert [kv_head_partition(8, 4, r) for r in range(4)] == [Partition(4, r) for r in range(4)]
    assert [kv_head_partition(2, 4, r).index for r in range(4)] == [0, 0, 1, 1]  # each head on two ranks
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        kv_head_partition(2, 3, 0)


def test_parallel_config_lays_ranks_out_node_by_node() -> None:
    assert list(ParallelConfig(tensor_parallel_size=8, nnodes=2, node_rank=1).node_ranks) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="multiple of nnodes"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)


def test_step_message_is_plain_and_workers_get_the_forward_only() -> None:
    sched = Scheduler(BlockManager(64, 4, True), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, seed=1, repetition_penalty=1.2))
    b = Sequence("b", [7, 8], SamplingParams(max_tokens=3))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    step = build_step(out, (4,))
    assert [s.token_ids for s in step.seqs] == [[1, 2, 3, 4, 5], [7, 8]]
    assert step.sampled_seq_ids == [a.seq_id, b.seq_id]
    assert step.sampling[a.seq_id].history_ids == ([1, 2, 3, 4, 5], []) and step.sampling[b.seq_id].history_ids is None
    workers = step.for_workers()
    assert workers.sampling == {} and workers.seqs == step.seqs
    assert pickle.loads(pickle.dumps(workers)) == workers  # crosses a process boundary as it is


def test_schema_keywords_that_cannot_be_enforced_are_refused_by_path() -> None:
    from stoker.structured.spec import StructuredOutputs

    ok = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"enum": ["not", "contains"]}}}
    StructuredOutputs.from_schema(ok)  # properties named like keywords are fine
    for schema, where in [({"type": "array", "uniqueItems": True}, "schema.uniqueItems"),
                          ({"properties": {"a": {"not": {"type": "string"}}}}, "schema.properties.a.not"),
                          ({"anyOf": [{"type": "integer"}, {"contains": {"const": 1}}]}, "schema.anyOf[1].contains")]:
        with pytest.raises(ValueError, match=rf"keyword {re.escape(where)} cannot be enforced"):
            StructuredOutputs.from_schema(schema)
