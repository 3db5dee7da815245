"""KV-transfer counters under vLLM's metric names, kept by the scheduler side. [no torch]

vllm:nixl_xfer_time_seconds and vllm:nixl_bytes_transferred are histograms (one observation
per finished read, on the reading engine), vllm:nixl_num_failed_transfers and
vllm:nixl_num_kv_expired_reqs counters (the latter on the engine whose lease ran out),
vllm:external_prefix_cache_queries / _hits counters in tokens (prompt tokens asked of and
found on a remote engine). The server reads a `snapshot()` at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Bucket edges (vLLM's NIXL histograms use these decades)
XFER_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
BYTES_BUCKETS = (2**10, 2**14, 2**17, 2**20, 2**23, 2**26, 2**28, 2**30)


@dataclass
class Histogram:
    edges: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per edge, not cumulative; last: +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.edges) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for edge, c in zip([*map(str, self.edges), "+Inf"], self.counts):
            running += c
            out.append((edge, running))
        return out

    def copy(self) -> Histogram:
        return Histogram(self.edges, list(self.counts), self.total, self.count)


@dataclass
class KVTransferStats:
    xfer_time_seconds: Histogram = field(default_factory=lambda: Histogram(XFER_TIME_BUCKETS))
    bytes_transferred: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))
    num_failed_transfers: int = 0
    num_kv_expired_reqs: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_leased_blocks: int = 0  # gauge: blocks held for remote readers now

    def snapshot(self) -> KVTransferStats:
        return KVTransferStats(self.xfer_time_seconds.copy(), self.bytes_transferred.copy(), self.num_failed_transfers,
                               self.num_kv_expired_reqs, self.external_prefix_cache_queries,
                               self.external_prefix_cache_hits, self.num_leased_blocks)
