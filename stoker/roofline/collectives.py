"""Collective times by the alpha-beta model, with NCCL's published per-protocol latencies.

    T = base_latency + steps x hop_latency + bus_factor x S / (link_bw x protocol_bw_share)

Latencies come from NCCL's tuning model (src/graph/tuning.cc, via facts.md): base latency 6.6 us
for LL and 8.4 us for Simple; per-hop hardware latency 0.6 / 1.9 / 3.4 us (LL / LL128 / Simple) on
NVLink, 1.0 / 2.5 / 5.7 on PCIe, 2.7 / 4.0 / 14 on the network. facts.md gives no LL128 base
latency, so LL128 borrows Simple's (it is never the small-message winner anyway).

Bandwidth share per protocol: LL sends 4 bytes of flag with every 4 bytes of data (50%); LL128
uses 120 of every 128 bytes (~94%); Simple uses the whole line (NCCL docs, "NCCL_PROTO").

busbw = algbw x factor, as nccl-tests defines it (doc/PERFORMANCE.md): all-reduce 2(n-1)/n;
reduce-scatter, all-gather, all-to-all (n-1)/n; broadcast, reduce, send/recv 1.
Ring moves data in n-1 (reduce-scatter, all-gather) or 2(n-1) (all-reduce) hops; tree in
ceil(log2 n) hops each way. NCCL implements all-gather/reduce-scatter only as rings; the tree
figures for them model recursive doubling and are an estimate.

Custom (one-shot / two-shot) all-reduce, what vLLM, SGLang and TensorRT-LLM run for TP inside one
NVLink node instead of NCCL for small messages: every rank reads its peers' buffers over P2P in one
kernel. One-shot moves (n-1) x S per rank in one phase; two-shot is a reduce-scatter then an
all-gather, 2(n-1)/n x S in two phases. Latency per phase: CUSTOM_AR_LATENCY_US (below). vLLM's
CustomAllreduce (vllm/distributed/device_communicators/custom_all_reduce.py) runs only for world
sizes 2, 4, 6, 8, messages under max_size = 8 MiB, and beyond two GPUs only when fully NVLinked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.roofline.hardware import Interconnect

BASE_LATENCY_US = {"LL": 6.6, "LL128": 8.4, "Simple": 8.4}
HOP_LATENCY_US = {
    "nvlink": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
    "pcie": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
    "network": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
}
PROTOCOL_BW_SHARE = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
# Smallest measured latency of a custom all-reduce on H100 NVLink: 3.7 us (TP2, 512 B and TP4, 4 KiB;
# 4.8 / 5.9 us at TP4 / TP8 for 512 B) in sgl-project/sglang PR #2904's table (sgl_kernel's
# TensorRT-LLM-derived kernel, H100, "custom allreduce" rows). The smallest, so the ceiling built on it
# stays a bound for every engine that runs such a kernel.
CUSTOM_AR_LATENCY_US = 3.7
CUSTOM_AR_MAX_BYTES = 8 * 1024 * 1024  # vLLM CustomAllreduce max_size = 8192 * 1024
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)  # vLLM CustomAllreduce._SUPPORTED_WORLD_SIZES
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv")
ALGORITHMS = ("ring", "tree")


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for `n` ranks."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; choose one of: {', '.join(COLLECTIVES)}")


@dataclass(frozen=True)
class CollectiveTime:
    collective: str
    algorithm: str
    protocol: str
    n: int
    size_bytes: float
    time_s: float

    @property
    def algbw_gb_per_s(self) -> float:
        return self.size_bytes / self.time_s / 1e9 if self.time_s > 0 else math.inf

    @property
    def busbw_gb_per_s(self) -> float:
        return self.algbw_gb_per_s * bus_factor(self.collective, self.n)


def _hops(collective: str, algorithm: str, n: int) -> int:
    if collective == "all_to_all":
        # Not a ring: every rank posts a send and a receive to each peer inside one group call, all
        # in flight at once (nccl-tests' alltoall: ncclGroupStart, ncclSend/ncclRecv per peer,
        # ncclGroupEnd), so it waits one step's latency, not n - 1 serial hops.
        return 1
    if algorithm == "ring":
        return 2 * (n - 1) if collective == "all_reduce" else n - 1
    if algorithm == "tree":
        depth = math.ceil(math.log2(n))
        return 2 * depth if collective == "all_reduce" else depth
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")


def collective_time(
    collective: str,
    size_bytes: float,
    n: int,
    link: Interconnect,
    *,
    algorithm: str = "ring",
    protocol: str | None = None,
    efficiency: float = 1.0,
) -> CollectiveTime:
    """Time for one collective on `n` ranks; `protocol=None` picks the fastest of LL/LL128/Simple,
    as NCCL's tuner does. `efficiency` scales the link bandwidth (achievable share of line rate)."""
    if n < 1:
        raise ValueError("n (number of ranks) must be >= 1")
    if n == 1 or size_bytes <= 0:
        return CollectiveTime(collective, algorithm, protocol or "Simple", n, size_bytes, 0.0)
    if link.kind == "none" or link.gb_per_s <= 0:
        raise ValueError(f"link {link.name!r} cannot carry collectives; use nvlink4, pcie5, ib-ndr, ...")
    protocols = (protocol,) if protocol else tuple(BASE_LATENCY_US)
    best: CollectiveTime | None = None
    for proto in protocols:
        if proto not in BASE_LATENCY_US:
            raise ValueError(f"unknown protocol {proto!r}; choose LL, LL128 or Simple")
        latency = (BASE_LATENCY_US[proto] + _hops(collective, algorithm, n) * HOP_LATENCY_US[link.kind][proto]) * 1e-6
        bw = link.gb_per_s * 1e9 * PROTOCOL_BW_SHARE[proto] * efficiency
        t = latency + bus_factor(collective, n) * size_bytes / bw
        if best is None or t < best.time_s:
            best = CollectiveTime(collective, algorithm, proto, n, size_bytes, t)
    assert best is not None
    return best


def custom_all_reduce_time(size_bytes: float, n: int, link: Interconnect, *, efficiency: float = 1.0,
                           latency_us: float = CUSTOM_AR_LATENCY_US) -> CollectiveTime | None:
    """The faster of one-shot and two-shot custom all-reduce over NVLink P2P, or None where no
    engine runs one (no NVLink, an unsupported world size, or a message over 8 MiB):
        one-shot  T = latency + (n-1) x S / bw
        two-shot  T = 2 x latency + 2(n-1)/n x S / bw
    (bw = per-direction link bandwidth x efficiency)."""
    if n == 1 or size_bytes <= 0:
        return CollectiveTime("all_reduce", "one_shot", "custom", n, size_bytes, 0.0)
    if link.kind != "nvlink" or n not in CUSTOM_AR_WORLD_SIZES or size_bytes > CUSTOM_AR_MAX_BYTES:
        return None
    bw = link.gb_per_s * 1e9 * efficiency
    one = latency_us * 1e-6 + (n - 1) * size_bytes / bw
    two = 2 * latency_us * 1e-6 + 2 * (n - 1) / n * size_bytes / bw
    algorithm, t = ("one_shot", one) if one <= two else ("two_shot", two)
    return CollectiveTime("all_reduce", algorithm, "custom", n, size_bytes, t)


def all_reduce_time(size_bytes: float, n: int, link: Interconnect, *, efficiency: float = 1.0,
                    custom: bool = True) -> CollectiveTime:
    """Fastest of NCCL ring and tree (protocol auto-selected) and, with `custom`, the one-/two-shot
    custom all-reduce engines run inside an NVLink node: what an engine that picks the best gets."""
    ring = collective_time("all_reduce", size_bytes, n, link, algorithm="ring", efficiency=efficiency)
    tree = collective_time("all_reduce", size_bytes, n, link, algorithm="tree", efficiency=efficiency)
    options = [ring, tree]
    if custom:
        one_shot = custom_all_reduce_time(size_bytes, n, link, efficiency=efficiency)
        if one_shot is not None:
            options.append(one_shot)
    return min(options, key=lambda c: c.time_s)


def alpha_beta_time(collective: str, size_bytes: float, n: int, alpha_s: float, beta_bytes_per_s: float,
                    algorithm: str = "ring") -> float:
    """The alpha-beta model with a measured link (facts.md: ring all-reduce
    T = 2(n-1) alpha + 2(n-1)/n x S / beta): alpha per hop, beta the link's bytes/s. For a
    transport NCCL's tuning table does not describe (gloo over TCP, say), fitted by
    `fit_alpha_beta` from a microbenchmark of the same collective."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return _hops(collective, algorithm, n) * alpha_s + bus_factor(collective, n) * size_bytes / beta_bytes_per_s


def fit_alpha_beta(samples: list[tuple[float, float]], collective: str, n: int, algorithm: str = "ring") -> tuple[float, float]:
    """Least-squares (alpha_s, beta_bytes_per_s) from (size_bytes, seconds) samples of one
    collective on n ranks: T = hops x alpha + factor x S x (1 / beta) is linear in both."""
    if len({s for s, _ in samples}) < 2:
        raise ValueError("fitting alpha and beta needs samples of at least two message sizes")
    hops, factor = _hops(collective, algorithm, n), bus_factor(collective, n)
    xs = [factor * s for s, _ in samples]
    ts = [t for _, t in samples]
    m = len(xs)
    mean_x, mean_t = sum(xs) / m, sum(ts) / m
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts)) / sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_t - slope * mean_x
    slope = max(slope, 1e-15)  # a flat fit (noise) still gives a finite bandwidth
    return max(intercept, 0.0) / hops, 1.0 / slope
