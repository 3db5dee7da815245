"""`stoker router` settings, validated once. [no torch]"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.router.policy import POLICIES


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port[/]` -> `http://host:port` (vLLM's proxies take both)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"upstream URL {url!r}: use http://host:port")
    return url


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...] = ()  # balancer mode (with decode: one pool)
    prefill: tuple[str, ...] = ()  # disaggregated mode when not empty
    decode: tuple[str, ...] = ()
    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: float = 64
    balance_rel_threshold: float = 1.5
    prefix_chunk_chars: int = 64
    max_local_prefill_length: int = 1000  # tokens; Dynamo's name
    max_prefill_queue_size: float = 2  # waiting requests at the least-queued prefill server
    tokenizer: str | None = None  # local tokenizer folder; else the decode server's /tokenize
    metrics_interval_s: float = 1.0
    health_check_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0
    request_timeout_s: float | None = None  # None: a long generation is not cut
    max_request_body_bytes: int = 16 * 2**20  # stoker serve's default

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(normalize_url(u) for u in self.workers))
        object.__setattr__(self, "prefill", tuple(normalize_url(u) for u in self.prefill))
        object.__setattr__(self, "decode", tuple(normalize_url(u) for u in self.decode))
        if self.prefill and self.workers:
            raise ValueError("--worker-urls is the balancer's pool; with --prefill give the decode pool as --decode")
        if self.prefill and not self.decode:
            raise ValueError("--prefill needs at least one --decode URL (the servers that stream the answer)")
        if not (self.workers or self.decode):
            raise ValueError("give the servers to route to: --worker-urls URL... (or --prefill URL... --decode URL...)")
        for name, urls in (("--worker-urls/--decode", self.pool_urls), ("--prefill", self.prefill)):
            if len(set(urls)) != len(urls):
                raise ValueError(f"{name}: an upstream is listed twice")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError("--cache-threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.max_local_prefill_length < 0 or self.max_prefill_queue_size < 0:
            raise ValueError("--max-local-prefill-length and --max-prefill-queue-size must be >= 0")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be positive")
        for name, v in (("--metrics-interval-secs", self.metrics_interval_s),
                        ("--health-check-interval-secs", self.health_check_interval_s),
                        ("--prefill-timeout-secs", self.prefill_timeout_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def pool_urls(self) -> tuple[str, ...]:
        """The servers that answer clients: the balancer's workers or the decode pool."""
        return self.workers + self.decode
