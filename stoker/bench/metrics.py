"""Serving metrics from per-request results, defined as vLLM's `bench serve` defines them.

Definitions (shared/reference/facts.md): TTFT = sent -> first content chunk; ITL = gaps
between content chunks; TPOT = (E2EL - TTFT) / (output_tokens - 1), only for outputs of
more than one token (a one-token output has no "per output token after the first"; like
vLLM it is left out of TPOT statistics and counts as TPOT 0 against a TPOT SLO); E2EL =
sent -> last content chunk. Failed requests never enter latency statistics or token
counts. Goodput is completed requests per second meeting every SLO given (DistServe).
Percentiles interpolate linearly between order statistics (numpy's default), std is the
population standard deviation (numpy's default), so numbers match peers' tools.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stoker.bench.client import RequestResult

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile of already sorted values (numpy 'linear')."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def percentile_key(p: float) -> str:
    """vLLM's key spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


@dataclass(frozen=True)
class Summary:
    """Mean, median, std and asked percentiles of one latency metric, in milliseconds."""

    count: int
    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[float, float | None]

    @staticmethod
    def of(values_s: Sequence[float], percentiles: Sequence[float]) -> Summary:
        if not values_s:
            return Summary(0, None, None, None, {p: None for p in percentiles})
        ms = sorted(v * 1000.0 for v in values_s)
        mean = sum(ms) / len(ms)
        var = sum((v - mean) ** 2 for v in ms) / len(ms)
        return Summary(len(ms), mean, percentile(ms, 50), math.sqrt(var),
                       {p: percentile(ms, p) for p in percentiles})


@dataclass
class BenchMetrics:
    """Everything a report states about one run; JSON names via `as_dict()`."""

    duration: float
    completed: int
    failed: int
    failures: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_concurrent_requests: int
    mean_concurrency: float
    mean_input_len: float
    mean_output_len: float
    output_lens: list[int]
    input_lens: list[int]
    summaries: dict[str, Summary] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "failures": dict(self.failures),
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrent_requests": self.max_concurrent_requests,
            "mean_concurrency": self.mean_concurrency,
            "mean_input_len": self.mean_input_len,
            "mean_output_len": self.mean_output_len,
        }
        for name, s in self.summaries.items():
            out[f"mean_{name}_ms"] = s.mean
            out[f"median_{name}_ms"] = s.median
            out[f"std_{name}_ms"] = s.std
            for p, v in s.percentiles.items():
                out[f"{percentile_key(p)}_{name}_ms"] = v
        return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}: needs a number of milliseconds, got {value!r}") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {key}: must be a positive number of milliseconds, got {value!r}")
        slos[key] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`"50,90,99"` -> [50.0, 90.0, 99.0]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--percentiles takes comma-separated numbers like 50,90,99; got {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"--percentiles must be numbers in (0, 100], like 50,90,99; got {text!r}")
    return values


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (failed ones too: the server saw them)."""
    # Ends sort before starts at the same instant, so back-to-back requests don't overlap.
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def output_len(r: RequestResult, count_tokens: Callable[[str], int] | None) -> int:
    """Output tokens: usage.completion_tokens, else re-tokenized text, else content chunks."""
    if r.output_tokens is not None:
        return r.output_tokens
    if count_tokens is not None:
        return count_tokens(r.generated_text)
    return r.num_chunks


def compute_metrics(results: Sequence[RequestResult], duration: float, *,
                    percentiles: Sequence[float] = (50, 90, 99),
                    goodput: dict[str, float] | None = None,
                    count_tokens: Callable[[str], int] | None = None) -> BenchMetrics:
    """Aggregate a run. `duration` is seconds from the first send to the last completion."""
    if duration <= 0:
        raise ValueError(f"benchmark duration must be > 0 s, got {duration}")
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    in_lens: list[int] = []
    out_lens: list[int] = []
    good = 0
    failures: Counter[str] = Counter()
    for r in results:
        if not r.success:
            failures[r.error_reason or "unknown"] += 1
            continue
        n_out = output_len(r, count_tokens)
        n_in = r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
        in_lens.append(n_in)
        out_lens.append(n_out)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        tpot = 0.0  # one-token outputs: no TPOT statistic, and they meet any TPOT SLO
        if n_out > 1:
            tpot = (r.latency - r.ttft) / (n_out - 1)
            tpots.append(tpot)
        if goodput:
            observed = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            if all(observed[k] * 1000.0 <= slo for k, slo in goodput.items()):
                good += 1
    completed = len(ttfts)
    total_in, total_out = sum(in_lens), sum(out_lens)
    busy = sum(max(0.0, r.end - r.start) for r in results)
    return BenchMetrics(
        duration=duration,
        completed=completed,
        failed=len(results) - completed,
        failures=dict(sorted(failures.items())),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=completed / duration,
        request_goodput=(good / duration) if goodput else None,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_concurrent_requests=peak_concurrency(results),
        # Little's law: mean number in flight = total time in flight / wall time.
        mean_concurrency=busy / duration,
        mean_input_len=total_in / completed if completed else 0.0,
        mean_output_len=total_out / completed if completed else 0.0,
        output_lens=out_lens,
        input_lens=in_lens,
        summaries={
            "ttft": Summary.of(ttfts, percentiles),
            "tpot": Summary.of(tpots, percentiles),
            "itl": Summary.of(itls, percentiles),
            "e2el": Summary.of(e2els, percentiles),
        },
    )
