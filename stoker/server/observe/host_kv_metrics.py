"""The host KV tier on /metrics (--kv-offloading-size; docs/kv_offloading.md), under vLLM's names.

vLLM counts its offloading connector's prefix hits as `vllm:external_prefix_cache_*` (tokens),
beside the device cache's `vllm:prefix_cache_*`, so a dashboard tells the tiers apart; the
transfers and the CPU pool are its offloading connector's `vllm:kv_offload_*` families (the
flat store/load counters, and the older `total_bytes` with its `transfer_type` label). Block
counts of the copies have no vLLM name: `stoker:`. Bytes are all ranks' shards together.
Beside a KV connector (docs/kv_offloading.md) the external prefix cache is one pair of families,
as vLLM records one per admission: queries are the prompt tokens of every admission, hits the
tokens loaded from the host tier plus those read from a remote engine (never the same block).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stoker.core.host_kv_pool import HostKVStats


def host_kv_metrics(s: HostKVStats, labels: list[str], value: list[str], remote_hit_tokens: int = 0) -> Iterator[Metric]:
    """remote_hit_tokens: prompt tokens a KV connector read from a remote engine (0 without one)."""
    for name, doc, v in (
        ("vllm:external_prefix_cache_queries", "Prompt tokens of admissions that looked in the host KV tier", s.query_tokens),
        ("vllm:external_prefix_cache_hits", "Prompt tokens loaded from the host KV tier (or read from a remote "
                                            "engine) instead of computed", s.hit_tokens + remote_hit_tokens),
        ("vllm:kv_offload_cpu_block_lookup_total", "Blocks past the device prefix hit looked up in the host tier", s.lookup_blocks),
        ("vllm:kv_offload_cpu_block_hit_total", "Blocks found in the host tier", s.hit_blocks),
        ("vllm:kv_offload_cpu_block_miss_total", "Blocks looked up in the host tier and not found", s.lookup_blocks - s.hit_blocks),
        ("vllm:kv_offload_block_eviction_total", "Host-tier blocks evicted (least recently used) for newer ones", s.evicted_blocks),
        ("vllm:kv_offload_stores_skipped", "Evicted device blocks not saved: every host slot was in use by the step", s.skipped_saves),
        ("vllm:kv_offload_store_bytes", "Bytes copied from the device cache to the host tier", s.saved_bytes),
        ("vllm:kv_offload_load_bytes", "Bytes copied from the host tier to the device cache", s.loaded_bytes),
        ("stoker:kv_offload_store_blocks", "Blocks copied from the device cache to the host tier", s.saved_blocks),
        ("stoker:kv_offload_load_blocks", "Blocks copied from the host tier to the device cache", s.loaded_blocks),
    ):
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(value, v)
        yield c
    c = CounterMetricFamily("vllm:kv_offload_total_bytes", "Bytes moved by the host KV tier, by direction",
                            labels=[*labels, "transfer_type"])
    c.add_metric([*value, "GPU_to_CPU"], s.saved_bytes)
    c.add_metric([*value, "CPU_to_GPU"], s.loaded_bytes)
    yield c
    for name, doc, v in (
        ("vllm:kv_offload_cpu_cache_usage_perc", "Host KV tier usage (0-1): share of its blocks holding one", s.usage),
        ("stoker:kv_offload_cpu_total_blocks", "Blocks the host KV tier holds at most", s.num_blocks),
    ):
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric(value, v)
        yield g
