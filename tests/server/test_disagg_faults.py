"""Faults of disaggregated prefill/decode, each ending with every KV block free on both sides.
The servers run in this process (so the tests can look at their block managers), each with its
own NIXL agent and side channel; transport faults come from the test transport
(stoker/kv_transfer/faults.py) through kv_connector_extra_config."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer, free_port
from tests.server.test_disagg_serve import metric, two_legs

os.environ.setdefault("UCX_NET_DEVICES", "lo")

SHORT = "hello there"  # under one block of 16 tokens
PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def kv(policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    return {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                   "kv_load_failure_policy": policy,
                                   "kv_connector_extra_config": {"side_channel_port": free_port(), **extra}}}


@pytest.fixture(scope="module")
def servers(server_factory: Callable[..., LiveServer]) -> dict[str, LiveServer]:
    return {
        "prefill": server_factory(kv(kv_lease_duration=1.0)),
        "prefill_gone": server_factory(kv(kv_lease_duration=1.0)),
        # reads finish 1 s late and the prefill engine is never told: its lease must expire
        "decode": server_factory(kv(faults={"read_delay_s": 1.0, "lose_notifications": True})),
        "decode_fail": server_factory({**kv("fail"), "block_size": 32}),
    }


def all_free(*servers: LiveServer, timeout: float = 15.0) -> None:
    """Every block of each server back in its free list (leases ended, reads over), integrity whole."""
    deadline = time.monotonic() + timeout
    for live in servers:
        bm = live.engine.block_manager
        while bm.num_free_blocks != bm.num_blocks or live.engine.has_pending_kv_transfers():
            assert time.monotonic() < deadline, f"{bm.num_blocks - bm.num_free_blocks} KV blocks still held"
            time.sleep(0.05)
        live.engine.check_integrity()


def body(prompt: str = PROMPT, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}


def reference_text(live_server: LiveServer, b: dict[str, Any]) -> str:
    return httpx.post(live_server.url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]


def test_client_abort_while_decode_waits(servers: dict[str, LiveServer]) -> None:
    p, d = servers["prefill"], servers["decode"]
    first = {**body(), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(p.url + "/v1/completions", json=first, timeout=60).json()["kv_transfer_params"]
    with pytest.raises(httpx.ReadTimeout):  # the read takes 1 s: the client leaves first
        httpx.post(d.url + "/v1/completions", json={**body(), "kv_transfer_params": params}, timeout=0.4)
    all_free(d, p)
    assert metric(p.url, "vllm:nixl_num_kv_expired_reqs_total") >= 1  # never notified: the lease ran out


def test_lost_notification_expires_the_lease_and_is_counted(servers: dict[str, LiveServer],
                                                            live_server: LiveServer) -> None:
    p, d = servers["prefill"], servers["decode"]
    expired = metric(p.url, "vllm:nixl_num_kv_expired_reqs_total")
    _, r = two_legs(p.url, d.url, "/v1/completions", body())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference_text(live_server, body())
    all_free(d, p)
    assert metric(p.url, "vllm:nixl_num_kv_expired_reqs_total") == expired + 1


def test_a_reader_that_never_reads(servers: dict[str, LiveServer]) -> None:
    p = servers["prefill"]
    expired = metric(p.url, "vllm:nixl_num_kv_expired_reqs_total")
    first = {**body(), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(p.url + "/v1/completions", json=first, timeout=60)
    assert r.status_code == 200
    num_blocks = len(r.json()["kv_transfer_params"]["remote_block_ids"])
    assert num_blocks > 0
    leased = metric(p.url, "stoker:kv_leased_blocks")
    # held under the lease, or (on a loaded machine, past the 1 s lease already) expired and counted
    assert leased == num_blocks or (leased == 0 and metric(p.url, "vllm:nixl_num_kv_expired_reqs_total") == expired + 1)
    all_free(p)
    assert metric(p.url, "vllm:nixl_num_kv_expired_reqs_total") == expired + 1
    assert metric(p.url, "stoker:kv_leased_blocks") == 0


def _gone_params(servers: dict[str, LiveServer], prompt: str) -> dict[str, Any]:
    """A prefill leg's params, then its engine's side channel stops answering (the engine is gone)."""
    p = servers["prefill_gone"]
    first = {**body(prompt), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(p.url + "/v1/completions", json=first, timeout=60).json()["kv_transfer_params"]
    connector = p.engine.executor.driver_runner.kv_connector
    if connector.side_channel is not None:
        connector.side_channel.close()
        connector.side_channel = None
    return params


def test_prefill_gone_recomputes(servers: dict[str, LiveServer], live_server: LiveServer) -> None:
    d = servers["decode"]
    failed = metric(d.url, "vllm:nixl_num_failed_transfers_total")
    params = _gone_params(servers, PROMPT)
    r = httpx.post(d.url + "/v1/completions", json={**body(), "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference_text(live_server, body())
    assert metric(d.url, "vllm:nixl_num_failed_transfers_total") == failed + 1
    all_free(d, servers["prefill_gone"])


def test_prefill_gone_fails_clearly_under_policy_fail(servers: dict[str, LiveServer]) -> None:
    d = servers["decode_fail"]
    params = _gone_params(servers, SHORT)
    r = httpx.post(d.url + "/v1/completions", json={**body(SHORT), "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "cannot reach the prefill engine" in message and "kv_load_failure_policy is 'fail'" in message
    assert not d.state.engine.is_dead
    all_free(d, servers["prefill_gone"])


def test_a_compatibility_mismatch_is_refused_naming_the_field(servers: dict[str, LiveServer]) -> None:
    p, d = servers["prefill"], servers["decode_fail"]  # block size 16 against 32
    _, r = two_legs(p.url, d.url, "/v1/completions", body(SHORT))
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "KV transfer refused: block_size differs (this engine: 32, remote engine: 16)" in message
    all_free(d, p)
    ok = httpx.post(d.url + "/v1/completions", json=body(SHORT), timeout=60)  # the engine lives on
    assert ok.status_code == 200
    all_free(d)
