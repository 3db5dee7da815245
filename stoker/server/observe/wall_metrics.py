"""The wall verdict in /metrics and in the engine log line (issue 16).

Every step (engine thread) is judged by the WallModel (roofline/live.py) and counted:

    stoker:step_bound_total{kind, wall}          steps by kind (prefill|decode|mixed) and the wall
                                                 that dominates their prediction
    stoker:step_seconds_total{kind}              measured step time
    stoker:step_predicted_seconds_total{kind}    the cost model's time for the same steps
    stoker:step_flops_total{kind}, stoker:step_bytes_total{kind}
                                                 modelled work (per tensor-parallel rank)

so PromQL can take any rate; and, over the last `window_s` of steps, the gauges a person reads:

    stoker:mbu{kind}, stoker:mfu{kind}           share of the device's peak bandwidth / FLOP rate
    stoker:achieved_bytes_per_second{kind}, stoker:achieved_flops_per_second{kind}
    stoker:step_time_over_prediction{kind}       measured / predicted step time (1.0: as modelled)
    stoker:wall_info{device, profile, ...} = 1, stoker:ceiling_flops_per_second, stoker:ceiling_bytes_per_second

No wall model (a GPU the table lacks, a CPU with no device file): only the info is absent and
nothing is counted; the gauges never show made-up numbers.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from stoker.core.step import StepShape
from stoker.roofline.live import KINDS, StepVerdict, WallModel


_MAX_TRACKED_REQUESTS = 65536


@dataclass
class _Sums:
    steps: int = 0
    seconds: float = 0.0
    predicted: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    walls: dict[str, int] = field(default_factory=dict)

    def add(self, v: StepVerdict) -> None:
        self.steps += 1
        self.seconds += v.seconds
        self.predicted += v.predicted_s
        self.flops += v.flops
        self.bytes += v.bytes
        self.walls[v.wall] = self.walls.get(v.wall, 0) + 1

    @property
    def wall(self) -> str:
        return max(self.walls, key=self.walls.__getitem__)


class _Window:
    """Per-kind sums over the last ~window_s: two half-open buckets, the older dropped as time
    moves on, so a reading covers between window_s and 2 x window_s of steps."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()  # engine thread adds, scrapes and the log line read
        self._start = time.monotonic()
        self._current: dict[str, _Sums] = {}
        self._previous: dict[str, _Sums] = {}

    def add(self, v: StepVerdict) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._start > self.window_s:
                self._previous, self._current, self._start = self._current, {}, now
            self._current.setdefault(v.kind, _Sums()).add(v)

    def read(self) -> dict[str, _Sums]:
        with self._lock:
            if time.monotonic() - self._start > 2 * self.window_s:  # idle: nothing recent
                return {}
            out: dict[str, _Sums] = {}
            for bucket in (self._previous, self._current):
                for kind, s in bucket.items():
                    o = out.setdefault(kind, _Sums())
                    o.steps += s.steps
                    o.seconds += s.seconds
                    o.predicted += s.predicted
                    o.flops += s.flops
                    o.bytes += s.bytes
                    for w, n in s.walls.items():
                        o.walls[w] = o.walls.get(w, 0) + n
            return out


class WallMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, window_s: float = 10.0) -> None:
        self.model_name = model_name
        self.model: WallModel | None = None
        self.window = _Window(window_s)
        # request id -> its steps by wall, only with --enable-request-timing; bounded, so a
        # request nobody reads back (its client left) cannot grow it for ever
        self._per_request: collections.OrderedDict[str, dict[str, int]] | None = None
        self._lock = threading.Lock()
        ln = ["model_name", "kind"]
        self.bound = Counter("stoker:step_bound", "Engine steps by kind and by the wall that dominates their "
                             "predicted time (memory, compute, overhead, collective)", ["model_name", "kind", "wall"],
                             registry=registry)
        self.seconds = Counter("stoker:step_seconds", "Measured engine step time", ln, registry=registry)
        self.predicted = Counter("stoker:step_predicted_seconds", "The roofline cost model's time for the same steps",
                                 ln, registry=registry)
        self.flops = Counter("stoker:step_flops", "Modelled FLOPs of the steps (matmuls and attention, per rank)", ln,
                             registry=registry)
        self.bytes = Counter("stoker:step_bytes", "Modelled bytes the steps moved (weights, KV, activations, per rank)",
                             ln, registry=registry)
        registry.register(_WindowCollector(self))

    def set_model(self, model: WallModel | None) -> None:
        self.model = model

    def track_requests(self) -> None:
        """--enable-request-timing: keep, per request, its steps by wall (request_steps)."""
        self._per_request = collections.OrderedDict()

    def request_steps(self, request_id: str) -> dict[str, int] | None:
        """The request's steps by wall ("unjudged" without a wall model), once: the entry is
        dropped. Complete once its last output is delivered (counted before it is sent)."""
        if self._per_request is None:
            return None
        with self._lock:
            return self._per_request.pop(request_id, {})

    def observe(self, shape: StepShape, seconds: float, request_ids: Sequence[str] = ()) -> None:
        """Engine thread, after every step."""
        judged = self.model is not None and seconds > 0 and shape.num_tokens > 0
        v = self.model.judge(shape, seconds) if judged else None
        if self._per_request is not None:
            self._count_for(request_ids, v.wall if v is not None else "unjudged")
        if v is None:
            return
        name, kind = self.model_name, v.kind
        self.bound.labels(name, kind, v.wall).inc()
        self.seconds.labels(name, kind).inc(v.seconds)
        self.predicted.labels(name, kind).inc(v.predicted_s)
        self.flops.labels(name, kind).inc(v.flops)
        self.bytes.labels(name, kind).inc(v.bytes)
        self.window.add(v)

    def _count_for(self, request_ids: Sequence[str], wall: str) -> None:
        assert self._per_request is not None
        with self._lock:
            for rid in request_ids:
                steps = self._per_request.setdefault(rid, {})
                steps[wall] = steps.get(wall, 0) + 1
            while len(self._per_request) > _MAX_TRACKED_REQUESTS:
                self._per_request.popitem(last=False)

    def summary(self) -> str | None:
        """"decode: 71% of the memory wall; 0.93x of prediction" per kind seen lately."""
        if self.model is None:
            return None
        parts = []
        for kind, s in sorted(self.window.read().items(), key=lambda kv: KINDS.index(kv[0])):
            wall = s.wall
            ratio = s.seconds / s.predicted if s.predicted else 0.0
            if wall in ("memory", "compute"):
                share = (s.bytes / self.model.peak_bytes_per_s if wall == "memory" else s.flops / self.model.peak_flops)
                head = f"{100 * share / s.seconds:.0f}% of the {wall} wall"
            else:
                head = f"{wall}-bound"
            parts.append(f"{kind}: {head}; {ratio:.2f}x of prediction")
        return "; ".join(parts) or None


class _WindowCollector:
    def __init__(self, wall: WallMetrics) -> None:
        self.wall = wall

    def collect(self) -> Iterator[Metric]:
        model = self.wall.model
        if model is None:
            return
        info = GaugeMetricFamily("stoker:wall_info", "The device, profile and dtypes the wall verdict prices steps with",
                                 labels=["model_name", "device", "profile", "weight_dtype", "kv_dtype", "tp"])
        info.add_metric([self.wall.model_name, model.device.name, model.profile, model.weight_dtype, model.kv_dtype,
                         str(model.tp)], 1.0)
        yield info
        for name, doc, value in (("stoker:ceiling_flops_per_second", "Peak FLOP/s the verdict divides by", model.peak_flops),
                                 ("stoker:ceiling_bytes_per_second", "Peak memory bytes/s the verdict divides by",
                                  model.peak_bytes_per_s)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.wall.model_name], value)
            yield g
        sums = self.wall.window.read()
        specs = (
            ("stoker:mbu", "Model bandwidth utilization over the last steps: modelled bytes / time / peak",
             lambda s: s.bytes / s.seconds / model.peak_bytes_per_s),
            ("stoker:mfu", "Model FLOP utilization over the last steps: modelled FLOPs / time / peak",
             lambda s: s.flops / s.seconds / model.peak_flops),
            ("stoker:achieved_bytes_per_second", "Modelled bytes moved per second of step time, last steps",
             lambda s: s.bytes / s.seconds),
            ("stoker:achieved_flops_per_second", "Modelled FLOPs per second of step time, last steps",
             lambda s: s.flops / s.seconds),
            ("stoker:step_time_over_prediction", "Measured / predicted step time over the last steps (1: as modelled)",
             lambda s: s.seconds / s.predicted if s.predicted else 0.0),
        )
        for name, doc, fn in specs:
            g = GaugeMetricFamily(name, doc, labels=["model_name", "kind"])
            for kind, s in sums.items():
                if s.seconds > 0:
                    g.add_metric([self.wall.model_name, kind], fn(s))
            yield g
