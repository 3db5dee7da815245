"""`stoker serve --kv-offloading-size` as a client and a dashboard see it: a prompt evicted from a
tiny device cache answers the same text from host memory, and /metrics counts the host tier's
hits apart from the device cache's, under vLLM's names."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import httpx

from tests.server.conftest import MODEL, LiveServer

LABEL = '{model_name="tiny-llama"}'


def _complete(live: LiveServer, prompt: list[int]) -> str:
    r = httpx.post(live.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_host_tier_hits_are_served_and_counted(server_factory: Callable[..., LiveServer],
                                               live_server: LiveServer) -> None:
    tiered = server_factory({"num_gpu_blocks_override": 16, "kv_offloading_size": 1 / 1024})
    rng = random.Random(5)
    history, noise = [rng.randrange(5, 1000) for _ in range(150)], [rng.randrange(5, 1000) for _ in range(200)]
    queried = tiered.metrics()[f"vllm:external_prefix_cache_queries_total{LABEL}"]  # after any start-up request
    first = _complete(tiered, history)
    _complete(tiered, noise)  # the history's blocks leave the 16-block device cache for host memory
    assert _complete(tiered, history) == first == _complete(live_server, history)
    tiered.wait_idle()
    m = tiered.metrics()
    hits = m[f"vllm:external_prefix_cache_hits_total{LABEL}"]
    assert hits > 0 and hits % 16 == 0, m
    assert m[f"vllm:external_prefix_cache_queries_total{LABEL}"] - queried == 150 + 200 + 150
    assert m[f"vllm:kv_offload_cpu_block_hit_total{LABEL}"] == hits / 16
    assert m[f"vllm:kv_offload_load_bytes_total{LABEL}"] == hits / 16 * 8192  # 16 tokens x 512 bytes per block
    assert m[f"vllm:kv_offload_store_bytes_total{LABEL}"] >= m[f"vllm:kv_offload_load_bytes_total{LABEL}"]
    assert m['vllm:kv_offload_total_bytes_total{model_name="tiny-llama",transfer_type="CPU_to_GPU"}'] > 0
    assert 0 < m[f"vllm:kv_offload_cpu_cache_usage_perc{LABEL}"] <= 1
    assert m[f"stoker:kv_offload_cpu_total_blocks{LABEL}"] == 128
    # the device hits stay vllm:prefix_cache_hits: host hits are not counted twice
    assert m[f"vllm:prefix_cache_hits_total{LABEL}"] + hits <= 144
    assert not any(k.startswith(("vllm:kv_offload", "vllm:external_prefix")) for k in live_server.metrics())
    engine = tiered.engine
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and engine.host_kv.is_idle


def test_the_flags_reach_the_engine() -> None:
    import inspect

    from stoker.engine.args import add_engine_args, engine_kwargs
    from stoker.engine.llm import LLM

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--kv-offloading-size", "4.5", "--kv-offloading-backend", "native"])
    kwargs = engine_kwargs(args)
    assert kwargs["kv_offloading_size"] == 4.5 and kwargs["kv_offloading_backend"] == "native"
    assert {"kv_offloading_size", "kv_offloading_backend"} <= set(inspect.signature(LLM.__init__).parameters)
    assert engine_kwargs(parser.parse_args(["--model", "m"]))["kv_offloading_size"] is None
