"""`LLM(kv_transfer_config=...)`: two engines in this process, a prefill engine and a decode
engine, each with its own NIXL agent; the decode engine READs the prompt's K/V and its greedy
tokens equal an aggregated engine's, with a float cache, an FP8 cache on both sides and an MLA
latent cache (one tensor per layer). The decode engine computes one prompt token per request."""

from __future__ import annotations

import os
from typing import Any

import pytest

from stoker import LLM, SamplingParams
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
