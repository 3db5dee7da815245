"""Disaggregated prefill/decode between two `stoker serve` processes on loopback, each at
tensor parallelism 2 over gloo (a driver and a worker process each: every decode rank reads the
same prefill rank's KV heads with its own NIXL agent), driven as vLLM's toy proxy drives a vLLM
pair: the prefill leg with max_tokens 1 and kv_transfer_params {"do_remote_decode": true}, then
the original request with the params the prefill answered. Both keep an FP8 KV cache, so the
bytes read are FP8 blocks. Greedy outputs equal one aggregated TP=1 FP8 server's, and the
decode server computes one prompt token per request (the rest came over NIXL). Float-cache and
TP=1 pairs run in this process (test_disagg_faults.py, tests/unit/test_kv_transfer_engines.py)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer, free_port, start_serve_process, stop_process

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NIXL's UCX on loopback only (the serve processes inherit it)

PROCESSES: list = []  # (prefill, decode) serve processes of the module's pair
TP = 2  # both servers of the pair
KV_DTYPE = "fp8"  # both servers of the pair, and the aggregated reference
LONG = "the quick brown fox jumps over the lazy dog and then " * 6


def kv_config(port: int, **extra: Any) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"side_channel_port": port, "load_timeout_s": 5, **extra}})


def free_port_pair() -> int:
    """A free port whose next one is free too (rank 1's side channel)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def two_legs(prefill: str, decode: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], httpx.Response]:
    """(the prefill leg's kv_transfer_params, the decode leg's response): a proxy's two legs."""
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    first.pop("stream_options", None)
    r = httpx.post(prefill + path, json=first, timeout=60)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    return params, httpx.post(decode + path, json={**body, "kv_transfer_params": params}, timeout=60)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_all_free(*urls: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while metric(url, "vllm:kv_cache_usage_perc") != 0 or metric(url, "stoker:kv_leased_blocks") != 0:
            assert time.monotonic() < deadline, f"{url} still holds KV blocks"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs = tmp_path_factory.mktemp("disagg")
    common = [str(tiny_llama), "--max-model-len", "256", "--served-model-name", MODEL,
              "--kv-cache-memory-bytes", str(8 * 2**20), "--tensor-parallel-size", str(TP), "--device", "cpu", "--kv-cache-dtype", KV_DTYPE]
    # both start at once (each loads torch and the model in two processes: most of this file's time);
    # each rank's side channel listens on the engine's port + rank
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_serve_process, [*common, "--kv-transfer-config", kv_config(free_port_pair())],
                               logs / f"{role}.log", 300) for role in ("prefill", "decode")]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(started) == 2, [str(f.exception()) for f in futures]
        PROCESSES[:] = [proc for proc, _ in started]
        yield started[0][1], started[1][1]
    finally:
        for proc, _ in started:
            stop_process(proc)


@pytest.fixture(scope="module")
def aggregated(server_factory: Callable[..., LiveServer]) -> LiveServer:
    """One aggregated TP=1 server (in this process) with the pair's KV cache dtype: the reference."""
    return server_factory({"kv_cache_dtype": KV_DTYPE})


def reference(live_server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(live_server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("prompt", ["hi", LONG], ids=["shorter-than-a-block", "several-blocks"])
def test_completion_equals_the_aggregated_server(pair: tuple[str, str], aggregated: LiveServer, prompt: str) -> None:
    prefill, decode = pair
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    computed = metric(decode, "vllm:prompt_tokens_total")
    params, r = two_legs(prefill, decode, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False and params["tp_size"] == TP
    assert params["remote_block_ids"] and params["remote_port"] > 0 and params["remote_engine_id"]
    assert r.json()["choices"][0]["text"] == reference(aggregated, "/v1/completions", body)["choices"][0]["text"]
    # the decode server computed the last prompt token only (for its logits): the rest was read
    assert metric(decode, "vllm:prompt_tokens_total") - computed == 1
    assert metric(decode, "vllm:nixl_xfer_time_seconds_count") >= 1
    wait_all_free(prefill, decode)


def test_a_partial_prefix_hit_on_the_decode_side_reads_only_the_rest(pair: tuple[str, str], aggregated: LiveServer) -> None:
    prefill, decode = pair
    head = "a partial prefix that the decode server has cached already " * 4
    warm = httpx.post(decode + "/v1/completions", json={"model": MODEL, "prompt": head, "max_tokens": 1}, timeout=60)
    assert warm.status_code == 200
    body = {"model": MODEL, "prompt": head + "and then something new", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    asked = metric(decode, "vllm:external_prefix_cache_queries_total")
    params, r = two_legs(prefill, decode, "/v1/completions", body)
    assert r.status_code == 200, r.text
    prompt_len = r.json()["usage"]["prompt_tokens"]
    read = metric(decode, "vllm:external_prefix_cache_queries_total") - asked
    assert 0 < read < prompt_len - 16  # at least one block came from the decode server's own cache
    assert r.json()["choices"][0]["text"] == reference(aggregated, "/v1/completions", body)["choices"][0]["text"]
    wait_all_free(prefill, decode)


def test_a_streamed_decode_leg(pair: tuple[str, str], aggregated: LiveServer) -> None:
    prefill, decode = pair
    body = {"model": MODEL, "prompt": LONG + "streamed", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, r = two_legs(prefill, decode, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == reference(aggregated, "/v1/completions", body)["choices"][0]["text"]
    wait_all_free(prefill, decode)


def test_chat(pair: tuple[str, str], aggregated: LiveServer) -> None:
    prefill, decode = pair
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    params, r = two_legs(prefill, decode, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    want = reference(aggregated, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert r.json()["choices"][0]["message"]["content"] == want
    assert "kv_transfer_params" not in r.json()  # only a prefill leg answers params
    wait_all_free(prefill, decode)


def test_kv_transfer_params_without_a_connector_is_a_400(live_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(live_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and "--kv-transfer-config" in err["message"]


def test_bad_params_are_a_400_naming_the_field(pair: tuple[str, str]) -> None:
    _, decode = pair
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_prefill": True}}
    r = httpx.post(decode + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert "remote_block_ids" in r.json()["error"]["message"]


def test_stoker_router_drives_the_pair(pair: tuple[str, str], aggregated: LiveServer) -> None:
    """The whole path users set up: `stoker router --prefill URL --decode URL` in front of the pair
    (every prompt sent to the prefill server: max_local_prefill_length 0), driven by the openai
    client; answers, plain and streamed, equal the aggregated server's, and the KV came over NIXL."""
    from openai import OpenAI

    from stoker.router.app import create_app
    from stoker.router.config import RouterConfig
    from tests.server.conftest import serve_app
    from tests.server.test_router_disagg import metric as router_metric

    prefill, decode = pair
    router = serve_app(create_app(RouterConfig(prefill=(prefill,), decode=(decode,), max_local_prefill_length=0,
                                               metrics_interval_s=0.2, health_check_interval_s=0.2)),
                       ready_path="/health")
    try:
        client = OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        def ask(prompt: str, stream: bool) -> tuple[str, str]:
            """(the answer through the router, the aggregated server's)"""
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            want = reference(aggregated, "/v1/completions", {**body, "ignore_eos": True})["choices"][0]["text"]
            got = client.completions.create(**body, stream=stream, extra_body={"ignore_eos": True})
            return ("".join(c.choices[0].text for c in got if c.choices) if stream else got.choices[0].text), want

        reads = metric(decode, "vllm:nixl_xfer_time_seconds_count")
        computed = metric(decode, "vllm:prompt_tokens_total")
        got, want = ask(LONG + "through the router", stream=False)
        assert got == want
        got, want = ask("a different prompt, streamed " + LONG, stream=True)  # no prefix shared with the first
        assert got == want
        assert metric(decode, "vllm:nixl_xfer_time_seconds_count") - reads == 2
        # the decode server computed the last prompt token only, once per request; the rest was read
        assert metric(decode, "vllm:prompt_tokens_total") - computed == 2
        assert router_metric(router.url, "stoker_router:requests_total", route="remote_prefill") == 2
        assert router_metric(router.url, "stoker_router:upstream_errors_total") == 0
    finally:
        router.stop()
    wait_all_free(prefill, decode)


def test_the_prefill_process_killed_mid_lease_is_recomputed(pair: tuple[str, str], aggregated: LiveServer) -> None:
    """Last in this file: it kills the pair's prefill process while its blocks are leased; the decode
    server (which handshook with it earlier) fails the read and, under policy recompute, answers."""
    prefill, decode = pair
    body = {"model": MODEL, "prompt": LONG + "killed", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(prefill + "/v1/completions", json=first, timeout=60).json()["kv_transfer_params"]
    failed = metric(decode, "vllm:nixl_num_failed_transfers_total")
    PROCESSES[0].kill()
    PROCESSES[0].wait(30)
    r = httpx.post(decode + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference(aggregated, "/v1/completions", body)["choices"][0]["text"]
    assert metric(decode, "vllm:nixl_num_failed_transfers_total") == failed + 1
    wait_all_free(decode)
