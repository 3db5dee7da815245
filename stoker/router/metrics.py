"""The router's own Prometheus metrics, prefixed `stoker_router:` as vLLM's are `vllm:`. [no torch]

route: "aggregated" (balancer mode: one server does prefill and decode), "local_prefill"
(disaggregated mode, prefilled on the decode server) or "remote_prefill" (prefill server, then
decode server). Each router has its own registry, so several can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROUTES = ("aggregated", "local_prefill", "remote_prefill")
ENDPOINTS = ("completions", "chat")
# Seconds; the router's own share is under a millisecond (docs/benchmarks.md, Router), a TTFT
# is milliseconds to seconds.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("stoker_router:time_to_first_token_seconds",
                              "From the request's arrival to the first byte of its answer sent on (the first "
                              "streamed chunk, or the whole body when not streaming)", ["route"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("stoker_router:e2e_request_latency_seconds",
                             "From the request's arrival to the last byte of its answer", ["route"],
                             buckets=_TTFT_BUCKETS, registry=r)
        self.prefill_leg = Histogram("stoker_router:prefill_leg_seconds",
                                     "Duration of the prefill leg (remote_prefill route)", buckets=_TTFT_BUCKETS,
                                     registry=r)
        self.requests = Counter("stoker_router:requests", "Requests by route and endpoint",
                                ["route", "endpoint"], registry=r)
        self.local_reasons = Counter("stoker_router:local_prefill_reasons",
                                     "Why a request was prefilled on the decode server in disaggregated mode",
                                     ["reason"], registry=r)
        self.upstream_errors = Counter("stoker_router:upstream_errors",
                                       "Failed exchanges with an upstream (connection, timeout, 5xx, bad answer)",
                                       ["upstream", "role", "kind"], registry=r)
        self.healthy = Gauge("stoker_router:upstream_healthy", "1 if the upstream takes requests", ["upstream", "role"],
                             registry=r)
        self.load = Gauge("stoker_router:upstream_load",
                          "Requests queued or running at the upstream (the larger of the scraped and the in-flight "
                          "count)", ["upstream", "role"], registry=r)
        self.in_flight = Gauge("stoker_router:upstream_in_flight", "Requests this router has open at the upstream",
                               ["upstream", "role"], registry=r)
        # Every series visible from the first scrape, and each labelled child looked up once:
        # labels() takes a lock and builds a key on every call, on the request path.
        self.ttft_of = {route: self.ttft.labels(route) for route in ROUTES}
        self.e2e_of = {route: self.e2e.labels(route) for route in ROUTES}
        self.requests_of = {(route, ep): self.requests.labels(route, ep) for route in ROUTES for ep in ENDPOINTS}
