"""The wall, live: every engine step priced by the cost model and judged against its ceiling.

Pure Python per step (a few dozen multiplications): the server feeds it each step's shape
(`core/step.py` `StepShape`: prefill tokens and what they attend, decodes and the context they
read) and its measured seconds; it answers with the step's modelled FLOPs and bytes, the
achieved rates they imply, their share of the device's peaks (MFU, MBU, as Databricks defines
them: facts.md), the predicted step time and the wall that dominates the prediction.

    wall = WallModel(spec, device, eff)                     # once, when the engine is loaded
    v = wall.judge(shape, seconds)                           # every step
    v.mbu, v.mfu, v.wall, v.measured_over_predicted
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.core.step import StepShape
from stoker.roofline.costmodel import compute_dtype, mixed_step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec
from stoker.roofline.modelspec import ModelSpec

# The cost model's names for what bounds an op -> the wall a dashboard shows.
_WALLS = {"memory": "memory", "compute": "compute", "overhead": "overhead", "communication": "collective"}
WALLS = ("memory", "compute", "overhead", "collective")
# A step taking more than this many times its modelled time is held by what the model does not
# price (host work, launch gaps, a stalled thread): its wall is "overhead", whatever the modelled
# bound. The cost model's own overhead terms count already; this catches the rest.
OVERHEAD_RATIO = 2.0
KINDS = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class StepVerdict:
    kind: str  # prefill | decode | mixed
    seconds: float  # measured
    predicted_s: float  # the cost model with the profile's efficiencies
    flops: float  # modelled (matmuls and attention), per tensor-parallel rank
    bytes: float  # modelled weights + KV + activations moved, per rank
    wall: str  # memory | compute | collective: the largest share of the prediction; overhead: that, or
    # the step took over OVERHEAD_RATIO x its prediction
    peak_flops: float
    peak_bytes_per_s: float

    @property
    def achieved_flops_per_s(self) -> float:
        return self.flops / self.seconds if self.seconds > 0 else 0.0

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.achieved_flops_per_s / self.peak_flops

    @property
    def mbu(self) -> float:
        return self.achieved_bytes_per_s / self.peak_bytes_per_s

    @property
    def measured_over_predicted(self) -> float:
        return self.seconds / self.predicted_s if self.predicted_s > 0 else 0.0


class WallModel:
    """The cost model of one served model on one device, decided once at start-up."""

    def __init__(self, spec: ModelSpec, device: GPUSpec, eff: Efficiencies, *, weight_dtype: str = "bf16",
                 kv_dtype: str = "bf16", act_dtype: str = "bf16", tp: int = 1, profile: str = "engine") -> None:
        self.spec = spec
        self.device = device
        self.eff = eff
        self.weight_dtype = weight_dtype
        self.kv_dtype = kv_dtype
        self.act_dtype = act_dtype
        self.tp = tp
        self.profile = profile  # the efficiency profile's name, for the log and the info gauge
        self.peak_flops = device.peak_flops(compute_dtype(weight_dtype, device))
        self.peak_bytes_per_s = device.hbm_bytes_per_s

    def judge(self, shape: StepShape, seconds: float) -> StepVerdict:
        cost = mixed_step_cost(
            self.spec, self.device, prefill_tokens=shape.num_prefill_tokens, prefill_attended=shape.prefill_attended,
            decode_seqs=shape.num_decode_seqs, decode_context=shape.decode_context, logits_rows=shape.num_sampled,
            draft_tokens=shape.num_draft_tokens, draft_attended=shape.draft_attended,
            weight_dtype=self.weight_dtype, kv_dtype=self.kv_dtype, tp=self.tp, eff=self.eff, act_dtype=self.act_dtype,
            with_floor=False,  # the verdict divides by the peaks; the floor would double the work per step
        )
        wall = _WALLS.get(cost.bound, cost.bound)
        if seconds > OVERHEAD_RATIO * cost.step_time_s:
            wall = "overhead"
        return StepVerdict(shape.kind, seconds, cost.step_time_s, cost.flops, cost.bytes, wall,
                           self.peak_flops, self.peak_bytes_per_s)

    def describe(self) -> str:
        return (f"{self.spec.name} on {self.device.name} (tp {self.tp}, {self.weight_dtype} weights, {self.kv_dtype} KV; "
                f"peaks {self.peak_flops / 1e12:.3g} TFLOP/s, {self.peak_bytes_per_s / 1e9:.3g} GB/s; "
                f"{self.profile} efficiencies)")
