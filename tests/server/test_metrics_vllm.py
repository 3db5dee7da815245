"""vLLM's V1 metrics as dashboards read them, and GET /tokenizer_info (issue 15, part 7).

The series list below is what the PromQL of vLLM's example Grafana dashboard queries
(vllm-project/vllm, examples/observability/prometheus_grafana/grafana.json), written out by
hand: each must be exported by /metrics and move under load. The per-request histograms are
also checked against what the responses themselves report.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from tests.server.conftest import MODEL, LiveServer

# Every series a query of vLLM's example dashboard reads (its panels: E2E Request Latency, Token
# Throughput, Inter Token Latency, Scheduler State, Time To First Token Latency, Cache
# Utilization, Request Prompt Length, Request Generation Length, Finish Reason, Queue Time,
# Requests Prefill and Decode Time, Max Generation Token in Sequence Group).
GRAFANA_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}

# The metrics vLLM V1 always registers (vllm/v1/metrics/loggers.py), by their `# TYPE` name in the
# text format (a counter's carries `_total`, as prometheus_client writes vLLM's too).
VLLM_V1_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}

MAX_TOKENS = 64  # every request below generates exactly this many per choice (ignore_eos)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def _scrape(live: LiveServer) -> str:
    return urllib.request.urlopen(live.url + "/metrics", timeout=10).read().decode()


def _by_series(live: LiveServer) -> dict[str, float]:
    """Series name (labels dropped) -> the sum of its samples (all labels, all `le`)."""
    out: dict[str, float] = {}
    for key, value in live.metrics().items():
        name = key.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + value
    return out


def _types(text: str) -> dict[str, str]:
    return {parts[2]: parts[3] for line in text.splitlines() if line.startswith("# TYPE ") for parts in [line.split()]}


def _buckets(live: LiveServer, name: str) -> list[float]:
    return sorted(float(key.split('le="', 1)[1].split('"', 1)[0]) for key in live.metrics()
                  if key.startswith(name + "_bucket{"))


@pytest.fixture(scope="module")
def busy_server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    """Two sequences at a time, so concurrent requests have to wait (the waiting gauge moves);
    a server of its own, so nothing else moves its counters."""
    return server_factory({"max_num_seqs": 2})


def _load(live: LiveServer) -> list[int]:
    """Four requests at once (five sequences for two slots): completions with n=2, streamed,
    plain, and a chat. Returns each request's usage.prompt_tokens."""
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})

    def n2() -> int:
        out = client.completions.create(prompt=PROMPT, n=2, **kw)
        assert [len(c.text) > 0 for c in out.choices] == [True, True]
        assert out.usage.completion_tokens == 2 * MAX_TOKENS
        return out.usage.prompt_tokens

    def streamed() -> int:
        usage = None
        for chunk in client.completions.create(prompt="Streamed: " + PROMPT, stream=True,
                                               stream_options={"include_usage": True}, **kw):
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
        return usage.prompt_tokens

    def plain() -> int:
        out = client.completions.create(prompt="Plain: " + PROMPT, **kw)
        assert out.usage.completion_tokens == MAX_TOKENS
        return out.usage.prompt_tokens

    def chat() -> int:
        out = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
        assert out.usage.completion_tokens == MAX_TOKENS
        return out.usage.prompt_tokens

    with ThreadPoolExecutor(4) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in (n2, streamed, plain, chat)]]


def test_grafana_dashboard_series_move_under_load(busy_server: LiveServer) -> None:
    before = _by_series(busy_server)
    peaks: dict[str, float] = {}
    done = threading.Event()

    def sample_gauges() -> None:  # gauges move only while requests run
        while not done.is_set():
            now = _by_series(busy_server)
            for g in GAUGES:
                peaks[g] = max(peaks.get(g, 0.0), now.get(g, 0.0))

    sampler = threading.Thread(target=sample_gauges)
    sampler.start()
    try:
        prompt_tokens = _load(busy_server)
    finally:
        done.set()
        sampler.join(30)
    busy_server.wait_idle()
    after = _by_series(busy_server)

    missing = [s for s in GRAFANA_SERIES if s not in after]
    assert not missing, f"not exported: {missing}"
    still = [s for s in GRAFANA_SERIES if (peaks.get(s, 0.0) if s in GAUGES else after[s] - before.get(s, 0.0)) <= 0]
    assert not still, f"did not move under load: {still}"

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # What the four requests were (n = 2, 1, 1, 1; MAX_TOKENS each choice), seen by the histograms.
    assert delta("vllm:request_params_n_count") == 4 and delta("vllm:request_params_n_sum") == 5
    assert delta("vllm:request_params_max_tokens_sum") == 4 * MAX_TOKENS
    assert delta("vllm:request_generation_tokens_sum") == 5 * MAX_TOKENS == delta("vllm:generation_tokens_total")
    assert delta("vllm:request_max_num_generation_tokens_sum") == 4 * MAX_TOKENS
    assert delta("vllm:request_prompt_tokens_count") == 4
    assert delta("vllm:request_prompt_tokens_sum") == sum(prompt_tokens)
    # Per step: prompt tokens computed + tokens sampled, so the steps add up to the counters.
    assert delta("vllm:iteration_tokens_total_sum") == delta("vllm:prompt_tokens_total") + delta("vllm:generation_tokens_total")
    assert delta("vllm:iteration_tokens_total_count") >= MAX_TOKENS
    # Phases: inference = prefill + decode; per-request TPOT = decode / (tokens - 1).
    for name in ("prefill", "decode", "inference"):
        assert delta(f"vllm:request_{name}_time_seconds_count") == 4
    assert delta("vllm:request_decode_time_seconds_sum") > 0
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum"), abs=1e-6)
    assert delta("vllm:request_time_per_output_token_seconds_count") == 4
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        delta("vllm:request_decode_time_seconds_sum") / (MAX_TOKENS - 1), rel=1e-6)


def test_every_vllm_v1_metric_with_its_type_and_buckets(busy_server: LiveServer) -> None:
    types = _types(_scrape(busy_server))
    wrong = {name: types.get(name) for name, kind in VLLM_V1_METRICS.items() if types.get(name) != kind}
    assert not wrong, f"missing or of another type: {wrong}"

    inf = float("inf")
    # build_1_2_5_buckets(max_model_len = 256), as vLLM builds them
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens"):
        assert _buckets(busy_server, name) == [1, 2, 5, 10, 20, 50, 100, 200, inf], name
    assert _buckets(busy_server, "vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                                    8192, 16384, inf]
    assert _buckets(busy_server, "vllm:request_params_n") == [1, 2, 5, 10, 20, inf]
    assert _buckets(busy_server, "vllm:request_time_per_output_token_seconds") == _buckets(
        busy_server, "vllm:inter_token_latency_seconds")
    for phase in ("inference", "prefill", "decode"):
        assert _buckets(busy_server, f"vllm:request_{phase}_time_seconds") == _buckets(
            busy_server, "vllm:e2e_request_latency_seconds")

    [(key, value)] = [(k, v) for k, v in busy_server.metrics().items() if k.startswith("vllm:cache_config_info{")]
    assert value == 1
    for label in ('block_size="16"', 'num_gpu_blocks="512"', 'num_gpu_blocks_override="512"', 'cache_dtype="auto"',
                  'enable_prefix_caching="True"'):
        assert label in key, (label, key)


def test_build_1_2_5_buckets() -> None:
    from stoker.server.observe.metrics import build_1_2_5_buckets

    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)  # vLLM's docstring example
    assert build_1_2_5_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_tokenizer_info(live_server: LiveServer, tiny_llama) -> None:
    from stoker.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    resp = httpx.get(live_server.url + "/tokenizer_info", timeout=30)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template and "{%" in info["chat_template"]
    for key in ("eos_token", "bos_token", "pad_token"):
        assert info[key] == getattr(tok, key) and info[key], key
    assert info["model_max_length"] == tok.model_max_length
    assert "vocab_file" not in info and "merges_file" not in info
    # lm-eval's remote tokenizer takes the EOS id as the first token of encoding eos_token alone
    ids = httpx.post(live_server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    assert ids[0] == tok.eos_token_id


def test_tokenizer_info_needs_the_key_and_can_be_turned_off(server_factory: Callable[..., LiveServer]) -> None:
    live = server_factory(api_key="sekret", enable_tokenizer_info_endpoint=False)
    assert httpx.get(live.url + "/tokenizer_info", timeout=30).status_code == 401
    resp = httpx.get(live.url + "/tokenizer_info", headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert resp.status_code == 404 and "--no-enable-tokenizer-info-endpoint" in resp.json()["error"]["message"]


def test_a_dense_model_exports_no_expert_load(busy_server: LiveServer) -> None:
    assert not any(k.startswith("stoker:moe_") for k in busy_server.metrics())


def test_moe_expert_load_in_metrics_and_the_engine_line(tiny_checkpoints) -> None:
    """Every (token, expert) pair a sparse layer routes is counted once: tokens x k per layer
    (Qwen3-MoE with layer 1 dense); balancedness is mean / max of a layer's counts; the
    periodic engine line gives it over the interval."""
    from stoker.server.observe.metrics import EngineLogLine
    from tests.server.conftest import start_server

    ckpt = tiny_checkpoints("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16,
                            norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])
    live = start_server(ckpt)
    try:
        def per_layer() -> dict[str, list[float]]:
            out: dict[str, list[float]] = {}
            for key, value in live.metrics().items():
                if key.startswith("stoker:moe_expert_tokens_total{"):
                    out.setdefault(key.split('layer="', 1)[1].split('"', 1)[0], []).append(value)
            return out

        line = EngineLogLine()
        assert line.line(live.state.engine) is None  # the first call only sets the baseline
        before = per_layer()  # the server's warm-up request routed some already
        prompt, max_tokens = [5, 17, 300, 42, 7, 99, 12], 8
        resp = httpx.post(live.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        live.wait_idle()
        fed = len(prompt) + max_tokens - 1  # the last sampled token is never fed back
        after = per_layer()
        assert sorted(after) == ["0", "2"] and all(len(c) == 4 for c in after.values())
        assert {layer: sum(after[layer]) - sum(before[layer]) for layer in after} == {"0": fed * 2, "2": fed * 2}
        samples = live.metrics()
        for layer, counts in after.items():
            [balance] = [v for k, v in samples.items() if k.startswith("stoker:moe_balancedness{") and f'layer="{layer}"' in k]
            assert balance == pytest.approx(sum(counts) / 4 / max(counts))
        assert _types(_scrape(live))["stoker:moe_expert_tokens_total"] == "counter"
        text = line.line(live.state.engine)
        assert text is not None and "MoE balancedness" in text and "worst layer" in text, text
    finally:
        live.stop()
