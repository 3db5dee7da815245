"""Prometheus metrics under vLLM's names (dashboards and routers expect them), the per-request
log line, and the periodic engine log line.

Gauges and token counters are read at scrape time from the engine's last snapshot (taken
on the engine thread after every step), so scraping never touches the engine itself.
Histograms are fed by `ServerMetrics`, the AsyncEngine's observer, called on the engine
thread with each admitted request's parameters, each step's token count and each step's
outputs. Where vLLM has no name, the name starts with `stoker:`.

Every metric vLLM V1 always registers is here, with its name, type and bucket edges.
One difference: vLLM splits an n > 1 request into n engine requests and observes each; here a
request is observed once (as `vllm:request_success` always counted it), its generation tokens
summed over its n choices (its usage.completion_tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stoker.core.expert_load import ExpertLoad
from stoker.core.spec_decode_stats import SpecDecodingStats
from stoker.core.step import StepShape
from stoker.engine.async_engine import AsyncEngine
from stoker.outputs import RequestOutput
from stoker.sampling_params import SamplingParams
from stoker.server.observe.host_kv_metrics import host_kv_metrics
from stoker.server.observe.wall_metrics import WallMetrics

logger = logging.getLogger("stoker.server")

# vLLM's bucket edges (seconds), so dashboards built for vLLM read ours the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's edges for per-request token counts,
    which depend on max_model_len (so those histograms are made once the model is loaded)."""
    edges: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


class _EngineCollector:
    """Gauges and cumulative counters from the engine snapshot, computed per scrape."""

    def __init__(self, model_name: str, get_engine: Callable[[], AsyncEngine | None]) -> None:
        self.model_name = model_name
        self.get_engine = get_engine

    def collect(self) -> Iterator[Metric]:
        engine = self.get_engine()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("stoker:engine_healthy", "1 while the engine loop runs, 0 before it starts or after it died",
                    1.0 if engine is not None and engine.is_running else 0.0)
        if engine is None:
            return
        snap = engine.snapshot
        s = snap.stats
        yield gauge("vllm:num_requests_running", "Requests with a sequence in the running batch (n > 1 counts once)", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (n > 1 counts once)", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (0-1): share of blocks held by live sequences", s.kv_cache_usage)
        yield counter("vllm:prompt_tokens", "Prompt tokens computed (prefill)", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated", s.generation_tokens)
        yield counter("vllm:num_preemptions", "Sequences preempted to free KV blocks", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits)
        if s.host_kv is not None:  # the host KV tier (--kv-offloading-size): its hits counted apart
            # beside a KV connector, vllm:external_prefix_cache_hits counts both tiers' tokens (disjoint blocks)
            remote = s.kv_transfer.external_prefix_cache_hits if s.kv_transfer is not None else 0
            yield from host_kv_metrics(s.host_kv, labels, value, remote_hit_tokens=remote)
        if engine.info.max_loras is not None:
            # vLLM's: an info gauge whose labels name the adapters in use, valued at the scrape time
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(engine.info.max_loras), ",".join(s.running_loras),
                          ",".join(s.waiting_loras)], time.time())
            yield g
        if s.spec_decoding is not None:
            yield from self._spec_decoding(s.spec_decoding, labels, value)
        if s.kv_transfer is not None:  # a KV connector's (stoker/kv_transfer/metrics.py)
            from stoker.kv_transfer.metrics import kv_transfer_metrics

            yield from kv_transfer_metrics(s.kv_transfer, labels, value, external_prefix_cache=s.host_kv is None)
        yield from self._expert_load(engine)
        yield gauge("stoker:kv_cache_free_blocks", "Free KV-cache blocks", snap.num_free_blocks)
        yield gauge("stoker:kv_cache_total_blocks", "KV-cache blocks allocated at start-up", snap.num_blocks)
        yield gauge("stoker:num_requests_queued", "Sequences (n per request) admitted by the server with no output yet (what --max-waiting-requests bounds)", engine.num_queued)
        yield self._cache_config_info(engine)

    @staticmethod
    def _spec_decoding(sd: SpecDecodingStats, labels: list[str], value: list[str]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py names them)."""
        for name, doc, v in (
            ("vllm:spec_decode_num_drafts", "Sequences that verified drafts, summed over steps", sd.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified", sd.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", sd.num_accepted_tokens),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            yield c
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each position of the draft (0 first)",
                                labels=[*labels, "position"])
        for pos, v in enumerate(sd.num_accepted_tokens_per_pos):
            c.add_metric([*value, str(pos)], v)
        yield c

    def _expert_load(self, engine: AsyncEngine) -> Iterator[Metric]:
        """MoE models only: tokens routed per expert per layer, and each layer's balancedness
        (mean / max tokens per expert, since start). vLLM exports no expert load yet, hence the
        stoker: names. Read from rank 0's device counters here, per scrape, never per step."""
        try:
            load = engine.expert_load()
        except Exception:  # a scrape must never fail on a dead engine's counters
            logger.debug("reading the expert load failed", exc_info=True)
            return
        if load is None:
            return
        tokens = CounterMetricFamily("stoker:moe_expert_tokens",
                                     "(token, expert) pairs routed to each expert of each MoE layer (a token counts "
                                     "once per chosen expert: tokens x num_experts_per_tok per layer)",
                                     labels=["model_name", "layer", "expert"])
        balance = GaugeMetricFamily("stoker:moe_balancedness",
                                    "Per MoE layer: mean / max tokens per expert since start (1: even; 1/E: one expert "
                                    "took every token); absent until the layer saw a token", labels=["model_name", "layer"])
        for layer, counts in load.tokens.items():
            for expert, n in enumerate(counts):
                tokens.add_metric([self.model_name, str(layer), str(expert)], n)
            b = load.balancedness(layer)
            if b is not None:
                balance.add_metric([self.model_name, str(layer)], b)
        yield tokens
        yield balance

    @staticmethod
    def _cache_config_info(engine: AsyncEngine) -> GaugeMetricFamily:
        """vLLM's info-style gauge: always 1, the cache configuration in its labels (label names
        and str() values as vLLM writes them, e.g. "True", "None"). The config is fixed once the
        engine is built, so reading it here is safe."""
        cc = engine.info.cache_config
        info = {
            "block_size": cc.block_size,
            "cache_dtype": cc.kv_cache_dtype,
            "enable_prefix_caching": cc.enable_prefix_caching,
            "gpu_memory_utilization": cc.gpu_memory_utilization,
            "kv_cache_memory_bytes": cc.kv_cache_memory_bytes,
            "num_gpu_blocks": engine.snapshot.num_blocks,  # on CPU too: the blocks the cache holds
            "num_gpu_blocks_override": cc.num_gpu_blocks_override,
        }
        g = GaugeMetricFamily("vllm:cache_config_info", "The KV-cache configuration, in the labels (value always 1)",
                              labels=list(info))
        g.add_metric([str(v) for v in info.values()], 1.0)
        return g


@dataclass
class _Trace:
    last_time: float  # when the observer last saw the token count grow (inter-token latency)
    num_tokens: int
    last_token_time: float | None  # the engine's first-token time, then the observer's, as tokens come


@dataclass
class _RequestSizes:
    """Per-request histograms whose bucket edges depend on max_model_len."""

    prompt_tokens: Any
    generation_tokens: Any
    max_num_generation_tokens: Any
    params_max_tokens: Any


class ServerMetrics:
    """One registry per app, so several servers can live in one process (tests)."""

    def __init__(self, model_name: str, get_engine: Callable[[], AsyncEngine | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, get_engine))
        r, ln = self.registry, ["model_name"]
        self.wall = WallMetrics(r, model_name)  # the wall verdict per step (wall_metrics.py)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", ln, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive tokens of a request", ln, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", ln, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled", ln, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        # vLLM's phase split of a finished request (its buckets are the e2e ones):
        # inference = prefill + decode = first scheduled to last token.
        self.inference = Histogram("vllm:request_inference_time_seconds", "First scheduled to last token",
                                   ln, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first token",
                                 ln, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.decode = Histogram("vllm:request_decode_time_seconds", "First token to last token",
                                ln, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: decode time / (output tokens - 1), 0 for a one-token output (its longest choice when n > 1)",
                              ln, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step (prompt + generated)",
                                          ln, buckets=_ITERATION_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.params_n = Histogram("vllm:request_params_n", "The n of each finished request", ln, buckets=_N_BUCKETS,
                                  registry=r).labels(model_name)
        self.sizes: _RequestSizes | None = None  # made by engine_loaded(max_model_len)
        self._params: dict[str, tuple[int, int | None]] = {}  # request id -> (n, max_tokens)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason", ["model_name", "finished_reason"], registry=r)
        self.rejected = Counter("stoker:requests_rejected", "Requests refused before reaching the engine, by HTTP status", ["model_name", "status"], registry=r)
        self.failed = Counter("stoker:requests_failed", "Requests that failed inside the engine", ln, registry=r).labels(model_name)
        self._traces: dict[str, _Trace] = {}
        try:  # GPU gauges (dcgm-exporter names) when the telemetry package and a GPU are there
            from stoker.telemetry.exporter import register_gpu_collector

            self.has_gpu_collector = bool(register_gpu_collector(self.registry))
        except ImportError:
            self.has_gpu_collector = False

    def reject(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def engine_loaded(self, max_model_len: int) -> None:
        """Make the per-request token histograms, whose edges are vLLM's 1-2-5 series up to
        max_model_len. Call before the engine starts stepping."""
        r, ln = self.registry, ["model_name"]
        edges = build_1_2_5_buckets(max_model_len)

        def hist(name: str, doc: str) -> Any:
            return Histogram(name, doc, ln, buckets=edges, registry=r).labels(self.model_name)

        self.sizes = _RequestSizes(
            prompt_tokens=hist("vllm:request_prompt_tokens", "Prompt tokens of each finished request"),
            generation_tokens=hist("vllm:request_generation_tokens", "Tokens generated by each finished request (all its n choices)"),
            max_num_generation_tokens=hist("vllm:request_max_num_generation_tokens",
                                           "Tokens generated by the longest choice of each finished request"),
            params_max_tokens=hist("vllm:request_params_max_tokens", "The max_tokens of each finished request"),
        )

    # ---- EngineObserver (engine thread)
    def on_added(self, request_id: str, params: SamplingParams) -> None:
        self._params[request_id] = (params.n, params.max_tokens)

    def on_step(self, num_tokens: int, shape: StepShape | None = None, seconds: float = 0.0,
                request_ids: list[str] | None = None) -> None:
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)
        if shape is not None:
            self.wall.observe(shape, seconds, request_ids or [])

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            trace = self._traces.get(out.request_id)
            m = out.metrics
            if trace is None:
                first_token_time = None
                if num_tokens and m is not None:
                    first_token_time = m.first_token_time or now
                    self.ttft.observe(max(first_token_time - m.arrival_time, 0.0))
                trace = self._traces[out.request_id] = _Trace(now, num_tokens, first_token_time)
            elif num_tokens > trace.num_tokens:
                self.itl.observe(now - trace.last_time)
                trace.last_time, trace.num_tokens, trace.last_token_time = now, num_tokens, now
            if out.finished:
                self._traces.pop(out.request_id, None)
                self._finish(out, now, trace)

    def on_failed(self, request_id: str) -> None:
        self._traces.pop(request_id, None)
        self._params.pop(request_id, None)
        self.failed.inc()

    def _finish(self, out: RequestOutput, now: float, trace: _Trace) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self.success.labels(self.model_name, reason or "abort").inc()
        n, max_tokens = self._params.pop(out.request_id, (len(out.outputs), None))
        lengths = [len(c.token_ids) for c in out.outputs]
        longest = max(lengths, default=0)
        self.params_n.observe(n)
        if self.sizes is not None:
            self.sizes.prompt_tokens.observe(len(out.prompt_token_ids))
            self.sizes.generation_tokens.observe(sum(lengths))
            self.sizes.max_num_generation_tokens.observe(longest)
            if max_tokens:  # vLLM skips an unset max_tokens too
                self.sizes.params_max_tokens.observe(max_tokens)
        m = out.metrics
        if m is None:
            return
        e2e = (m.finished_time or now) - m.arrival_time
        self.e2e.observe(e2e)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None and trace.last_token_time is not None:
                # A request aborted before its first token has no prefill or decode to report.
                decode = max(trace.last_token_time - m.first_token_time, 0.0)
                self.prefill.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
                self.decode.observe(decode)
                self.inference.observe(max(trace.last_token_time - m.first_scheduled_time, 0.0))
                # vLLM leaves out the first token (the prefill's); the longest choice spans the decode.
                self.tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)
        ttft = f"{m.first_token_time - m.arrival_time:.3f} s" if m.first_token_time else "-"
        logger.info(
            "request %s finished: prompt %d tokens, output %d tokens, TTFT %s, total %.3f s, finish_reason %s",
            out.request_id, len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), ttft, e2e,
            ",".join(sorted({c.finish_reason or "abort" for c in out.outputs})),
        )


class EngineLogLine:
    """The periodic engine line: load, KV usage, prefix-cache hit rate, token rates, the MoE
    experts' balancedness since the last line (MoE models), and the wall in words when the
    server judges steps ("decode: 71% of the memory wall; 0.93x of prediction")."""

    def __init__(self, wall_summary: Callable[[], str | None] | None = None) -> None:
        self._last: tuple[float, int, int, int, int] | None = None
        self.wall_summary = wall_summary
        self._last_load: ExpertLoad | None = None
        self._last_spec: SpecDecodingStats | None = None

    def line(self, engine: AsyncEngine) -> str | None:
        """The line to log now, or None when nothing happened since the last one."""
        s = engine.snapshot.stats
        now = time.monotonic()
        last = self._last
        self._last = (now, s.prompt_tokens, s.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits)
        if last is None:
            self._last_load = engine.expert_load()  # the baseline of the first interval (MoE only)
            return None
        dt = max(now - last[0], 1e-9)
        prompt_rate = (s.prompt_tokens - last[1]) / dt
        gen_rate = (s.generation_tokens - last[2]) / dt
        queries = s.prefix_cache_queries - last[3]
        idle = s.num_running == 0 and s.num_waiting == 0 and prompt_rate == 0 and gen_rate == 0
        if idle:
            return None
        hit_rate = 100.0 * (s.prefix_cache_hits - last[4]) / queries if queries else 0.0
        # Tensor parallelism: the step's all-reduces, measured vs the fitted collective model
        # (totals of plain floats kept by the engine thread; a racy read is off by a step at most).
        collectives = engine.collective_summary()
        wall = self.wall_summary() if self.wall_summary is not None else None
        # MoE: balancedness over the tokens routed since the last line (a device read, here only)
        load = engine.expert_load()
        experts = load.since(self._last_load).summary() if load is not None else None
        self._last_load = load
        spec = self._spec_line(s.spec_decoding)
        return (
            f"engine: running {s.num_running}, waiting {s.num_waiting}, KV usage {100 * s.kv_cache_usage:.1f}%, "
            f"prefix-cache hit rate {hit_rate:.1f}%, prompt {prompt_rate:.1f} tokens/s, generation {gen_rate:.1f} tokens/s"
            + (f", {collectives}" if collectives else "")
            + (f", {experts}" if experts else "")
            + (f"; {wall}" if wall else "")
            + (f"; {spec}" if spec else "")
        )

    def _spec_line(self, sd: SpecDecodingStats | None) -> str | None:
        """vLLM's "SpecDecoding metrics: ..." over the interval since the last line."""
        last, self._last_spec = self._last_spec, sd
        if sd is None:
            return None
        last = last or SpecDecodingStats(sd.num_spec_tokens)
        drafts = sd.num_drafts - last.num_drafts
        drafted = sd.num_draft_tokens - last.num_draft_tokens
        accepted = sd.num_accepted_tokens - last.num_accepted_tokens
        if not drafts:
            return None
        per_pos = [(a - b) / drafts for a, b in zip(sd.num_accepted_tokens_per_pos, last.num_accepted_tokens_per_pos)]
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")
