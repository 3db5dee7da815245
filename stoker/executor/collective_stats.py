"""The all-reduces of each step, measured, beside what the roofline's collective model says.

At start-up every rank runs a short all-reduce microbenchmark (4 KiB to 1 MiB, medians of 7)
and rank 0 fits the alpha-beta model to it (`roofline.collectives.fit_alpha_beta`): the
model of the backend in use (gloo over TCP on CPU, NCCL on GPUs), fitted only from the
microbenchmark, never from the steps it then predicts. Each step rank 0 takes the step's
all-reduces (sizes, seconds; `TensorParallelGroup.log`), predicts their time from the fit,
logs both at DEBUG and keeps totals that the server's periodic log line reports.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stoker.roofline.collectives import alpha_beta_time, fit_alpha_beta

logger = logging.getLogger(__name__)

CALIBRATION_SIZES = (4 << 10, 64 << 10, 1 << 20)  # bytes
_REPEATS = 7


@dataclass(frozen=True)
class LinkModel:
    backend: str
    alpha_s: float
    beta_bytes_per_s: float

    def all_reduce_s(self, size_bytes: int, n: int) -> float:
        return alpha_beta_time("all_reduce", size_bytes, n, self.alpha_s, self.beta_bytes_per_s)

    def describe(self) -> str:
        return f"{self.backend} alpha {self.alpha_s * 1e6:.1f} us, beta {self.beta_bytes_per_s / 1e9:.2f} GB/s"


def calibrate(tp, device: torch.device) -> LinkModel | None:
    """Every rank calls this together; rank 0 gets the fitted model (None elsewhere)."""
    samples: list[tuple[float, float]] = []
    for size in CALIBRATION_SIZES:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(_REPEATS + 2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(x, group=tp.device_group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:  # two warm-ups
                times.append(time.perf_counter() - start)
        samples.append((float(size), statistics.median(times)))
    if not tp.is_first:
        return None
    alpha, beta = fit_alpha_beta(samples, "all_reduce", tp.world_size)
    model = LinkModel(dist.get_backend(tp.device_group), alpha, beta)
    logger.info("all-reduce on %d ranks, fitted from %s: %s", tp.world_size,
                ", ".join(f"{s / 1024:.0f} KiB {t * 1e3:.3f} ms" for s, t in samples), model.describe())
    return model


class CollectiveMonitor:
    """Rank 0: per-step all-reduce time, measured and modelled."""

    def __init__(self, tp, model: LinkModel | None) -> None:
        self.tp, self.model = tp, model
        self.steps = self.calls = 0
        self.measured_s = self.predicted_s = 0.0
        self._since = (0, 0.0, 0.0)

    def after_step(self, step_s: float) -> None:
        log = self.tp.log.take()
        if not log.sizes:
            return
        predicted = sum(self.model.all_reduce_s(s, self.tp.world_size) for s in log.sizes) if self.model else 0.0
        self.steps += 1
        self.calls += len(log.sizes)
        self.measured_s += log.seconds
        self.predicted_s += predicted
        logger.debug("step %.2f ms: %d all-reduces, %d bytes, %.3f ms measured, %.3f ms modelled", step_s * 1e3,
                     len(log.sizes), sum(log.sizes), log.seconds * 1e3, predicted * 1e3)

    def summary(self) -> str | None:
        """Since the last call: all-reduce time per step, measured vs modelled."""
        steps, measured, predicted = (self.steps - self._since[0], self.measured_s - self._since[1],
                                      self.predicted_s - self._since[2])
        self._since = (self.steps, self.measured_s, self.predicted_s)
        if steps == 0:
            return None
        model = f" vs {predicted / steps * 1e3:.2f} ms modelled ({self.model.describe()})" if self.model else ""
        return f"all-reduce {measured / steps * 1e3:.2f} ms/step measured{model}"
