"""`LLM(kv_transfer_config=...)`: two engines in this process, a prefill engine and a decode
engine, each with its own NIXL agent; the decode engine READs the prompt's K/V and its greedy
tokens equal an aggregated engine's, with a float cache, an FP8 cache on both sides and an MLA
latent cache (one tensor per layer). The decode engine computes one prompt token per request."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from stoker import LLM, SamplingParams
from stoker.core.sequence import Sequence
from tests.server.conftest import free_port

os.environ.setdefault("UCX_NET_DEVICES", "lo")

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
           num_hidden_layers=2, q_lora_rank=None, topk_method="greedy")


def kv(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"side_channel_port": free_port(), **extra}}


def run(llm: LLM, rid: str, ids: list[int], params: SamplingParams) -> Any:
    e = llm.engine
    e.add_request(e.input_processor.process(rid, prompt_token_ids=ids, params=params))
    out = None
    while e.has_unfinished_requests():
        for o in e.step():
            out = o if o.finished else out
    return out


@pytest.mark.parametrize("arch, overrides, kv_cache_dtype, lengths", [
    ("llama", {}, "auto", (5, 16, 40)),  # under a block, exactly one, several and a part
    ("llama", {}, "fp8", (40,)),
    ("deepseek_v2", MLA, "auto", (40,)),
], ids=["float", "fp8-both-sides", "mla-latent"])
def test_decode_engine_reads_the_prompt_and_matches(tiny_checkpoints: Any, arch: str, overrides: dict,
                                                    kv_cache_dtype: str, lengths: tuple[int, ...]) -> None:
    path = str(tiny_checkpoints(arch, **overrides))
    kw = {"max_model_len": 128, "num_gpu_blocks_override": 32, "kv_cache_dtype": kv_cache_dtype, "block_size": 16}
    prefill = LLM(path, kv_transfer_config=kv(), **kw)
    decode = LLM(path, kv_transfer_config=kv(), **kw)
    local = LLM(path, **kw)
    try:
        for n, length in enumerate(lengths):
            ids = [(11 * i + 3 * n) % 200 + 3 for i in range(length)]
            greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            first = run(prefill, f"p{n}", ids, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
            params = first.kv_transfer_params
            assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == -(-length // 16)
            computed = decode.engine.stats().prompt_tokens
            out = run(decode, f"d{n}", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                          kv_transfer_params=params))
            assert decode.engine.stats().prompt_tokens - computed == 1  # the rest came over NIXL
            assert out.outputs[0].token_ids == run(local, f"l{n}", ids, greedy).outputs[0].token_ids
            while prefill.engine.has_pending_kv_transfers():  # the read's notification frees the lease
                prefill.engine.step()
        stats = decode.engine.stats().kv_transfer
        assert stats.xfer_time_seconds.count == len(lengths) and stats.num_failed_transfers == 0
        assert prefill.engine.stats().kv_transfer.num_kv_expired_reqs == 0
    finally:
        for llm in (prefill, decode, local):
            llm.shutdown()


def test_a_request_with_params_on_an_engine_without_a_connector_is_refused(tiny_checkpoints: Any) -> None:
    from stoker.engine.input_processor import InputError

    llm = LLM(str(tiny_checkpoints("llama")), max_model_len=64, num_gpu_blocks_override=8)
    with pytest.raises(InputError, match="--kv-transfer-config") as info:
        llm.engine.input_processor.process("r", prompt_token_ids=[1, 2], params=SamplingParams(
            kv_transfer_params={"do_remote_decode": True}))
    assert info.value.param == "kv_transfer_params"


def test_a_decode_leg_from_a_prefill_engine_of_another_tp_size_is_refused_by_name() -> None:
    """Equal TP only: each rank reads the same rank's heads of the prefill engine."""
    from stoker.engine.input_processor import InputError, InputLimits, InputProcessor

    limits = InputLimits(vocab_size=100, max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=True,
                         kv_transfer=True, tensor_parallel_size=2)
    proc = InputProcessor(None, limits, None, lambda: None)
    leg = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "p", "remote_host": "localhost",
           "remote_port": 5600}
    for tp in (1, 4):
        with pytest.raises(InputError, match=f"tp_size {tp}.*--tensor-parallel-size") as info:
            proc.process("r", prompt_token_ids=[1, 2], params=SamplingParams(kv_transfer_params={**leg, "tp_size": tp}))
        assert info.value.param == "kv_transfer_params"
    ok = proc.process("r", prompt_token_ids=[1, 2], params=SamplingParams(kv_transfer_params={**leg, "tp_size": 2}))
    assert ok.params.kv_transfer_params["tp_size"] == 2
    # a prefill leg names no tp_size: its response carries this engine's
    proc.process("r", prompt_token_ids=[1, 2], params=SamplingParams(kv_transfer_params={"do_remote_decode": True}))


def test_a_connector_across_nodes_is_refused_before_any_worker_starts(tiny_checkpoints: Any) -> None:
    with pytest.raises(ValueError, match="--nnodes"):
        LLM(str(tiny_checkpoints("llama")), tensor_parallel_size=2, nnodes=2, master_port=free_port(),
            kv_transfer_config=kv())


@pytest.mark.parametrize("fault", [None, "drop_reads"], ids=["read", "read-fails-recompute"])
def test_a_decode_engine_loads_its_host_tier_hit_and_reads_only_the_rest(tiny_llama: Any, fault: str | None) -> None:
    """--kv-offloading-size beside a NixlConnector: the decode engine's host tier holds the
    prompt's first 2 blocks (evicted from its device cache), so it loads those and READs only the
    third; a failed read (policy recompute) computes the rest past the host hit, which it keeps."""
    kw = {"max_model_len": 128, "num_gpu_blocks_override": 10, "block_size": 16}
    mib = 1 / 1024  # GiB: 128 host blocks of the tiny llama's 8 KiB
    faults = {"faults": {"drop_reads": True}} if fault else {}
    lease = 0.2 if fault else 60.0  # a dropped read never notifies: its lease must expire within the test
    prefill = LLM(str(tiny_llama), kv_transfer_config=kv(kv_lease_duration=lease), kv_offloading_size=mib, **kw)
    # the decode engine as vLLM / llm-d spell it: a MultiConnector of NIXL and the host tier
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        kv(**faults), {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}]}}
    decode = LLM(str(tiny_llama), kv_transfer_config=multi, **kw)
    assert decode.engine.config.cache_config.kv_offloading_size == mib
    local = LLM(str(tiny_llama), **kw)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        ids = [(7 * i) % 200 + 3 for i in range(40)]  # 3 blocks: 2 full, one part
        run(decode, "warm", ids[:32] + [1, 2], SamplingParams(max_tokens=1))  # caches ids' first 2 blocks
        for n in range(2):  # 8 of the 10 device blocks each: the warm prefix is evicted, to host
            run(decode, f"fill{n}", [(13 * i + n) % 200 + 3 for i in range(120)], SamplingParams(max_tokens=1))
        e = decode.engine
        assert not e.block_manager.find_cached_prefix(Sequence("probe", ids, greedy))
        first = run(prefill, "p", ids, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        hits, computed = e.host_kv.stats().hit_blocks, e.stats().prompt_tokens
        out = run(decode, "d", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   kv_transfer_params=first.kv_transfer_params))
        assert out.outputs[0].token_ids == run(local, "l", ids, greedy).outputs[0].token_ids
        assert e.host_kv.stats().hit_blocks - hits == 2
        stats = e.stats().kv_transfer
        assert stats.external_prefix_cache_hits == 40 - 32  # the remote engine claimed the third block only
        if fault:
            assert stats.num_failed_transfers == 1
            assert e.stats().prompt_tokens - computed == 40 - 32  # computed past the host hit, kept
        else:
            assert stats.num_failed_transfers == 0 and stats.xfer_time_seconds.count == 1
            assert stats.bytes_transferred.total == e.host_kv.bytes_per_block  # one block of K/V over NIXL
            assert e.stats().prompt_tokens - computed == 1
        deadline = time.monotonic() + 10
        while prefill.engine.has_pending_kv_transfers() and time.monotonic() < deadline:
            prefill.engine.step()  # the notification, or the lease's expiry when the read was dropped
        assert prefill.engine.stats().kv_transfer.num_kv_expired_reqs == (1 if fault else 0)
        saved = prefill.engine.host_kv.stats().saved_blocks
        for n in range(2):  # the prefill engine still offloads: its released prompt blocks go to host when evicted
            run(prefill, f"fill{n}", [(13 * i + n) % 200 + 3 for i in range(120)], SamplingParams(max_tokens=1))
        assert prefill.engine.host_kv.stats().saved_blocks - saved >= 2
        for llm in (prefill, decode):
            assert not llm.engine.has_pending_kv_transfers() and llm.engine.block_manager.num_free_blocks == 10
            llm.engine.check_integrity()  # both tiers
            assert llm.engine.host_kv.is_idle
    finally:
        for llm in (prefill, decode, local):
            llm.shutdown()
