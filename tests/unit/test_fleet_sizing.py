"""Fleet sizing reads a replica's KV bytes as the roofline does: windows honoured."""

from __future__ import annotations

import dataclasses

import pytest

from stoker.fleet.sizing import memory_need_bytes
from stoker.fleet.spec import DeploymentSpec
from stoker.roofline.modelspec import get_model_spec


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "llama-3-8b"])
def test_memory_need_counts_a_sliding_layer_up_to_its_window(preset: str) -> None:
    dep = DeploymentSpec("d", "m", preset, dtype="bfloat16", max_model_len=8192, max_num_seqs=8,
                         gpu_memory_utilization=1.0)
    spec = get_model_spec(preset)
    weights = spec.weight_bytes("bf16")
    kv = memory_need_bytes(dep) - weights
    full = spec.kv_bytes_per_token("bf16") * 8192 * 8
    if spec.num_sliding_layers:  # gpt-oss: half the layers hold 128 tokens, not 8192
        windowed = (spec.num_layers - spec.num_sliding_layers) * 8192 + spec.num_sliding_layers * 128
        assert kv == pytest.approx(full * windowed / (spec.num_layers * 8192), rel=1e-6) and kv < 0.6 * full
    else:
        assert kv == pytest.approx(full, rel=1e-6)
    longer = memory_need_bytes(dataclasses.replace(dep, max_model_len=16384)) - weights
    assert longer > kv
