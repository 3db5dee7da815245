"""Drive a run: send the requests on their arrival schedule under a concurrency cap.

The clock (`t0`) starts when the first request is due; duration ends when the last
request finishes, as in vLLM's `bench serve`. Requests are sent at absolute deadlines
from `arrivals.arrival_offsets`; with `max_concurrency` a due request waits for a free
slot, so the cap shapes the load exactly like a pool of that many users.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from stoker.bench.arrivals import arrival_offsets
from stoker.bench.client import Endpoint, RequestResult, RequestSpec, send_request
from stoker.bench.progress import BenchProgress


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    request_timeout: float = 600.0

    @classmethod
    def from_args(cls, args: Any) -> LoadConfig:
        """From `stoker bench serve`'s parsed flags."""
        return cls(request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                   seed=args.seed, request_timeout=args.request_timeout)

    def validate(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 s, got {self.request_timeout}")


@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration: float


def api_root(base_url: str) -> str:
    """`http://h:8000`, `http://h:8000/` and `http://h:8000/v1` all mean the same server."""
    root = base_url.rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
    return root[:-3] if root.endswith("/v1") else root


def endpoint_path(endpoint: str) -> tuple[str, bool]:
    """`completions` | `chat` | a path like `/v1/chat/completions` -> (path, is_chat)."""
    if endpoint in ("completions", "/v1/completions"):
        return "/v1/completions", False
    if endpoint in ("chat", "/v1/chat/completions"):
        return "/v1/chat/completions", True
    if endpoint.startswith("/"):
        return endpoint, "chat" in endpoint
    raise ValueError(f"--endpoint must be completions, chat or a path like /v1/completions; got {endpoint!r}")


def auth_headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def fetch_models(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's `/v1/models` answer. Unreachable server -> ValueError (fail before load)."""
    url = api_root(base_url) + "/v1/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url, headers=auth_headers(api_key)) as resp:
                if resp.status != 200:
                    return {"status": resp.status, "error": (await resp.text())[:500]}
                return await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise ValueError(f"cannot reach {url} ({type(exc).__name__}: {exc}); "
                         "is the server running? check --base-url") from None


def first_model_id(models: dict[str, Any]) -> str:
    data = models.get("data") or []
    if not data or "id" not in data[0]:
        raise ValueError("the server's /v1/models lists no model; pass --model NAME")
    return str(data[0]["id"])


async def run_load(endpoint: Endpoint, specs: list[RequestSpec], load: LoadConfig,
                   progress: BenchProgress | None = None, *, send: Any = send_request) -> RunOutcome:
    """Send every spec once; return per-request results in spec order and the duration.

    `send(session, endpoint, spec, t0, counters)` sends one request (default: a streamed
    completion; `bench/embeddings.py` passes its embeddings POST)."""
    load.validate()
    offsets = arrival_offsets(len(specs), load.request_rate, load.burstiness, load.seed)
    progress = progress or BenchProgress(total=len(specs), enabled=False)
    counters = progress.counters
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    # limit=0: aiohttp's own pool must never be a hidden concurrency cap (default is 100).
    connector = aiohttp.TCPConnector(limit=load.max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=load.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            if sem is not None:
                await sem.acquire()
            try:
                counters.sent += 1
                result = await send(session, endpoint, spec, t0, counters)
            finally:
                if sem is not None:
                    sem.release()
            if result.success:
                counters.completed += 1
            else:
                counters.failed += 1
            return result

        tasks: list[asyncio.Task[RequestResult]] = []
        with progress:
            for spec, offset in zip(specs, offsets):
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(spec)))
            results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    return RunOutcome(results=results, duration=duration)
