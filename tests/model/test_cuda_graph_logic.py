"""The pure logic of runner/cuda_graph.py on CPU: buckets, padding a decode step into the
static buffers, and the whole replay path with each graph stood in for by an eager run of
the captured body (so everything but the capture itself runs here; tests/gpu/ does that)."""

from __future__ import annotations

import types

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.attention import AttentionMetadata
from stoker.runner.cuda_graph import (
    CudaGraphRunner,
    StaticInputs,
    bucket_for,
    capture_sizes,
    fill_static_inputs,
    graphs_supported,
)


def test_capture_sizes() -> None:
    full = capture_sizes(256)
    assert full[:6] == [1, 2, 4, 8, 16, 24] and full[-1] == 256
    assert all(b - a == 8 for a, b in zip(full[4:], full[5:]))
    assert len(full) == 4 + 31
    assert capture_sizes(1000) == full  # capped at 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the limit itself is a bucket
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(64, max_size=32)[-1] == 32
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_for() -> None:
    sizes = capture_sizes(40)  # 1 2 4 8 16 24 32 40
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 33, 40)] == [1, 2, 4, 8, 8, 16, 24, 40, 40]
    assert bucket_for(41, sizes) is None


def _decode_metadata(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> AttentionMetadata:
    width = max(len(t) for t in block_tables)
    slots = [t[(c - 1) // block_size] * block_size + (c - 1) % block_size for t, c in zip(block_tables, context_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        cu_seqlens_q=list(range(len(context_lens) + 1)),
        context_lens_list=context_lens,
        num_decodes=len(context_lens),
    )


def test_fill_pads_rows_to_the_bucket() -> None:
    static = StaticInputs.allocate(8, 6, torch.device("cpu"))
    assert static.slot_mapping.tolist() == [-1] * 8

    # Three sequences (bucket 4) with 2, 1 and 3 blocks of 4 tokens.
    md = _decode_metadata([[5, 9], [3], [7, 1, 2]], [6, 2, 11], block_size=4)
    fill_static_inputs(static, 4, torch.tensor([11, 12, 13]), torch.tensor([5, 1, 10]), md)
    assert static.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert static.positions[:4].tolist() == [5, 1, 10, 0]
    assert static.slot_mapping[:4].tolist() == [9 * 4 + 1, 3 * 4 + 1, 2 * 4 + 2, -1]
    assert static.context_lens[:4].tolist() == [6, 2, 11, 0]
    assert static.block_tables[:4].tolist() == [
        [5, 9, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0], [7, 1, 2, 0, 0, 0], [0, 0, 0, 0, 0, 0],
    ]
    # The graph of bucket 4 sees exactly these rows through its metadata views.
    view = static.metadata(4)
    assert view.num_decodes == len(view.context_lens_list) == 4
    assert view.slot_mapping.data_ptr() == static.slot_mapping.data_ptr()
    assert view.block_tables.shape == (4, 6)

    # A later, smaller step into bucket 2 must turn stale real rows into padding.
    md = _decode_metadata([[4]], [3], block_size=4)
    fill_static_inputs(static, 2, torch.tensor([7]), torch.tensor([2]), md)
    assert static.slot_mapping[:2].tolist() == [4 * 4 + 2, -1]
    assert static.context_lens[:2].tolist() == [3, 0]
    assert static.block_tables[:2].tolist() == [[4, 0, 0, 0, 0, 0], [0] * 6]
    assert static.input_ids[:2].tolist() == [7, 0]

    with pytest.raises(AssertionError):  # a block table wider than max_model_len allows
        fill_static_inputs(static, 1, torch.tensor([1]), torch.tensor([0]), _decode_metadata([[1] * 7], [28], 4))


def test_graphs_not_supported_on_cpu() -> None:
    ok, why = graphs_supported(torch.device("cpu"))
    assert not ok and "cpu" in why


def test_cpu_engine_never_captures(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 20)
    assert llm.engine.executor.driver_runner.graph_runner is None


def test_replay_path_equals_eager_on_cpu(tiny_llama) -> None:
    """ModelRunner.execute through CudaGraphRunner.run (static buffers, padding, metadata views,
    static output) gives the eager engine's greedy tokens; each 'graph' is an eager stand-in."""
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 7, 33, 1)]  # 5 seqs: bucket 8
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 20, max_num_seqs=16)
    eager = LLM(str(tiny_llama), **kwargs).generate(prompts, params, use_tqdm=False)

    llm = LLM(str(tiny_llama), **kwargs)
    runner = llm.engine.executor.driver_runner
    with torch.inference_mode():
        graph_runner = CudaGraphRunner(
            runner.model, 16, runner.max_model_len, runner.block_size, runner.hf_config["hidden_size"], runner.dtype, runner.device
        )
    replays: list[int] = []

    def stand_in(bs: int) -> types.SimpleNamespace:
        def replay() -> None:
            replays.append(bs)
            graph_runner._forward(bs)

        return types.SimpleNamespace(replay=replay)

    graph_runner.graphs = {bs: stand_in(bs) for bs in graph_runner.sizes}
    runner.graph_runner = graph_runner
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    assert replays and set(replays) <= {8, 4, 2, 1}, replays  # decode steps only, padded to buckets
    assert 8 in replays
    llm.engine.check_integrity()

    # Eager beyond the largest bucket, for any step that is not pure decode, for tables
    # wider than max_model_len allows, and before capture.
    max_blocks = graph_runner.max_blocks_per_seq
    assert graph_runner.can_run(16, _decode_metadata([[1]] * 16, [3] * 16, 16))
    assert not graph_runner.can_run(17, _decode_metadata([[1]] * 17, [3] * 17, 16))
    assert not graph_runner.can_run(1, _decode_metadata([[1] * (max_blocks + 1)], [3], 16))
    mixed = _decode_metadata([[1], [2]], [3, 9], 16)
    mixed.num_decodes = 1  # the second sequence brings several tokens
    assert not graph_runner.can_run(2, mixed)
    graph_runner.graphs = {}
    assert not graph_runner.can_run(1, _decode_metadata([[1]], [3], 16))
