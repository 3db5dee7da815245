"""One upstream server (`stoker serve` or any vLLM-compatible server) as the router sees it:
its health, its load (requests this router has in flight there, and the queue depth and KV
usage the server itself reports on /metrics), and the loop that keeps both fresh. [no torch]

A failed request marks an upstream unhealthy at once; it is skipped until its /health answers
200 again (vLLM's meaning of /health: ready for requests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("stoker.router")

# vLLM's metric names, which `stoker serve` exports under the same names.
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
_SCRAPED = (WAITING, RUNNING, KV_USAGE)


def parse_load(text: str) -> dict[str, float]:
    """Sum of the samples of each scraped metric over its label sets (one per served model)."""
    out = dict.fromkeys(_SCRAPED, 0.0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        name = line[:name_end]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out


@dataclass
class Upstream:
    url: str  # "http://host:port", no trailing slash
    role: str  # "worker" (balancer), "prefill" or "decode"
    healthy: bool = True  # optimistic until a check or a request says otherwise
    in_flight: int = 0  # requests this router has open there
    waiting: float = 0.0  # server-reported, at the last scrape
    running: float = 0.0
    kv_usage: float = 0.0  # 0-1
    assigned: int = 0  # requests ever sent: the last tie-breaker, so idle replicas take turns
    scraped_at: float = field(default=0.0)
    in_flight_at_scrape: int = 0  # this router's requests there when the scrape was taken

    @property
    def others(self) -> float:
        """Requests other clients (other routers, direct users) had there at the last scrape."""
        return max(0.0, self.waiting + self.running - self.in_flight_at_scrape)

    @property
    def load(self) -> float:
        """Requests queued or running there: this router's own, counted exactly, plus the other
        clients' as last scraped. (Taking the scrape alone would keep counting requests of ours
        that have finished since, for up to one interval, and steer traffic away for nothing.)"""
        return self.in_flight + self.others

    def mark_unhealthy(self, why: str) -> None:
        if self.healthy:
            log.warning("upstream %s (%s) marked unhealthy: %s", self.url, self.role, why)
        self.healthy = False

    async def refresh(self, session: aiohttp.ClientSession, timeout_s: float) -> bool:
        """One check: an unhealthy upstream must answer /health with 200 to come back; then (or
        if healthy) /metrics is scraped for its load. A server without /metrics stays usable
        with in-flight counts only. True when the upstream has just come back."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            if not self.healthy:
                async with session.get(self.url + "/health", timeout=timeout) as r:
                    if r.status != 200:
                        return False
                log.warning("upstream %s (%s) healthy again", self.url, self.role)
                self.healthy = came_back = True
            else:
                came_back = False
            in_flight = self.in_flight
            async with session.get(self.url + "/metrics", timeout=timeout) as r:
                status, text = r.status, await r.text()
            in_flight = min(in_flight, self.in_flight)  # requests that ended meanwhile may be missing
        except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
            self.mark_unhealthy(f"{type(exc).__name__}: {exc}")
            return False
        if status == 503:  # stoker/vLLM: loading, engine dead or shutting down
            self.mark_unhealthy("/metrics answered 503")
        elif status == 200:
            load = parse_load(text)
            self.waiting, self.running, self.kv_usage = load[WAITING], load[RUNNING], load[KV_USAGE]
            self.in_flight_at_scrape = in_flight
            self.scraped_at = time.monotonic()
        return came_back


async def poll_forever(upstreams: list[Upstream], session: aiohttp.ClientSession, interval_s: float,
                       health_interval_s: float, on_recover: Callable[[Upstream], None]) -> None:
    """Refresh every upstream each `interval_s`; an unhealthy one is re-checked each
    `health_interval_s`; `on_recover` is told of each that comes back. Runs until cancelled
    (the router's shutdown); a check that fails in an unforeseen way is logged, not fatal."""
    last_check = dict.fromkeys((u.url, u.role) for u in upstreams)
    while True:
        now = time.monotonic()
        due = [u for u in upstreams if last_check[(u.url, u.role)] is None
               or now - last_check[(u.url, u.role)] >= (interval_s if u.healthy else health_interval_s)]
        for u in due:
            last_check[(u.url, u.role)] = now
        results = await asyncio.gather(*(u.refresh(session, timeout_s=max(1.0, interval_s)) for u in due),
                                       return_exceptions=True)
        for u, result in zip(due, results):
            if isinstance(result, Exception):
                log.error("checking upstream %s failed: %r", u.url, result)
            elif result:
                on_recover(u)
        await asyncio.sleep(min(interval_s, health_interval_s) / 2)
