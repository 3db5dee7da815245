"""Request arrival schedules: when each request of a run is sent.

Inter-arrival gaps follow a gamma distribution with shape = burstiness and mean 1 / rate,
as in vLLM's `bench serve` (see shared/reference/facts.md): burstiness 1 is a Poisson
process (exponential gaps, coefficient of variation 1); below 1 is burstier (CV > 1), above
1 is smoother (CV = 1 / sqrt(burstiness)); `inf` is the limit, a constant rate. The whole schedule is drawn up front from a
seeded generator so a run is reproducible and the dispatch loop only sleeps until absolute
deadlines (sleep overshoot never accumulates into drift).
"""

from __future__ import annotations

import math
import random


def validate_rate(request_rate: float, burstiness: float) -> None:
    """Raise ValueError naming the flag to change when rate or burstiness are unusable."""
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 requests/s or 'inf', got {request_rate}")
    if math.isnan(burstiness) or burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0 (1 = Poisson, inf = constant rate), got {burstiness}")


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times in seconds after the start of the run, one per request, non-decreasing.

    The first request goes at 0 (the clock starts when load starts). With an infinite rate
    every request is sent at 0 and only `--max-concurrency` throttles the load.
    """
    if num_requests < 0:
        raise ValueError(f"--num-prompts must be >= 0, got {num_requests}")
    validate_rate(request_rate, burstiness)
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):  # the limit of gamma as shape -> inf: evenly spaced sends
        return [i / request_rate for i in range(num_requests)]
    rng = random.Random(seed)
    # gamma(shape=k, scale=theta) has mean k * theta; theta = 1 / (rate * k) gives mean 1 / rate.
    theta = 1.0 / (request_rate * burstiness)
    offsets: list[float] = []
    now = 0.0
    for i in range(num_requests):
        if i > 0:
            now += rng.gammavariate(burstiness, theta)
        offsets.append(now)
    return offsets


def gaps(offsets: list[float]) -> list[float]:
    """Inter-arrival gaps of a schedule (len(offsets) - 1 of them)."""
    return [b - a for a, b in zip(offsets, offsets[1:])]
