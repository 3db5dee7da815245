"""Prometheus metrics under vLLM's names (dashboards and routers expect them), the per-request
log line, and the periodic engine log line.

Gauges and token counters are read at scrape time from the engine's last snapshot (taken
on the engine thread after every step), so scraping never touches the engine itself.
Latency histograms are fed by `RequestObserver`, which the AsyncEngine calls on its thread
with every step's outputs. Where vLLM has no name, the name starts with `stoker:`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stoker.engine.async_engine import AsyncEngine
from stoker.outputs import RequestOutput

logger = logging.getLogger("stoker.server")

# vLLM's bucket edges (seconds), so dashboards built for vLLM read ours the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


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
        yield gauge("stoker:kv_cache_free_blocks", "Free KV-cache blocks", snap.num_free_blocks)
        yield gauge("stoker:kv_cache_total_blocks", "KV-cache blocks allocated at start-up", snap.num_blocks)
        yield gauge("stoker:num_requests_queued", "Sequences (n per request) admitted by the server with no output yet (what --max-waiting-requests bounds)", engine.num_queued)


@dataclass
class _Trace:
    last_time: float
    num_tokens: int


class ServerMetrics:
    """One registry per app, so several servers can live in one process (tests)."""

    def __init__(self, model_name: str, get_engine: Callable[[], AsyncEngine | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, get_engine))
        r, ln = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", ln, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive tokens of a request", ln, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", ln, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled", ln, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
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

    # ---- EngineObserver (engine thread)
    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            trace = self._traces.get(out.request_id)
            m = out.metrics
            if trace is None:
                if num_tokens and m is not None:
                    self.ttft.observe(max((m.first_token_time or now) - m.arrival_time, 0.0))
                trace = self._traces[out.request_id] = _Trace(now, num_tokens)
            elif num_tokens > trace.num_tokens:
                self.itl.observe(now - trace.last_time)
                trace.last_time, trace.num_tokens = now, num_tokens
            if out.finished:
                self._traces.pop(out.request_id, None)
                self._finish(out, now)

    def on_failed(self, request_id: str) -> None:
        self._traces.pop(request_id, None)
        self.failed.inc()

    def _finish(self, out: RequestOutput, now: float) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self.success.labels(self.model_name, reason or "abort").inc()
        m = out.metrics
        if m is None:
            return
        e2e = (m.finished_time or now) - m.arrival_time
        self.e2e.observe(e2e)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        ttft = f"{m.first_token_time - m.arrival_time:.3f} s" if m.first_token_time else "-"
        logger.info(
            "request %s finished: prompt %d tokens, output %d tokens, TTFT %s, total %.3f s, finish_reason %s",
            out.request_id, len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), ttft, e2e,
            ",".join(sorted({c.finish_reason or "abort" for c in out.outputs})),
        )


class EngineLogLine:
    """The periodic engine line: load, KV usage, prefix-cache hit rate, token rates."""

    def __init__(self) -> None:
        self._last: tuple[float, int, int, int, int] | None = None

    def line(self, engine: AsyncEngine) -> str | None:
        """The line to log now, or None when nothing happened since the last one."""
        s = engine.snapshot.stats
        now = time.monotonic()
        last = self._last
        self._last = (now, s.prompt_tokens, s.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits)
        if last is None:
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
        collectives = engine.engine.executor.collective_summary()
        return (
            f"engine: running {s.num_running}, waiting {s.num_waiting}, KV usage {100 * s.kv_cache_usage:.1f}%, "
            f"prefix-cache hit rate {hit_rate:.1f}%, prompt {prompt_rate:.1f} tokens/s, generation {gen_rate:.1f} tokens/s"
            + (f", {collectives}" if collectives else "")
        )
