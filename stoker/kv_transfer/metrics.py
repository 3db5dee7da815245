"""The KV connector's Prometheus families under vLLM's names, from an engine snapshot's
`KVTransferStats` (the server's collector yields them at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from stoker.kv_transfer.stats import Histogram, KVTransferStats


def kv_transfer_metrics(s: KVTransferStats, labels: list[str], value: list[str],
                        external_prefix_cache: bool = True) -> Iterator[Metric]:
    """external_prefix_cache False: a host KV tier exports that pair, with these hits added
    (server/observe/host_kv_metrics.py), so each family is exported once."""
    def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
        m = HistogramMetricFamily(name, doc, labels=labels)
        m.add_metric(value, h.cumulative(), h.total)
        return m

    def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(value, v)
        return c

    yield histogram("vllm:nixl_xfer_time_seconds", "Transfer duration of NIXL KV cache reads", s.xfer_time_seconds)
    yield histogram("vllm:nixl_bytes_transferred", "Bytes moved per NIXL KV cache read", s.bytes_transferred)
    yield counter("vllm:nixl_num_failed_transfers", "Failed NIXL KV cache reads", s.num_failed_transfers)
    yield counter("vllm:nixl_num_kv_expired_reqs",
                  "Requests whose KV blocks no reader took before the lease ran out (counted on the prefill engine)",
                  s.num_kv_expired_reqs)
    if external_prefix_cache:
        yield counter("vllm:external_prefix_cache_queries", "Prompt tokens asked of a remote engine's KV cache",
                      s.external_prefix_cache_queries)
        yield counter("vllm:external_prefix_cache_hits", "Prompt tokens read from a remote engine's KV cache",
                      s.external_prefix_cache_hits)
    g = GaugeMetricFamily("stoker:kv_leased_blocks", "KV blocks held for remote readers", labels=labels)
    g.add_metric(value, s.num_leased_blocks)
    yield g
