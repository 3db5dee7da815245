"""Efficiencies fitted from this machine's microbenchmarks, and the step time they predict.

The held-out check of the cost model (issue 16, "the wall on this machine"): every number a
prediction uses comes from a microbenchmark of the hardware and kernels at the model's shapes,
never from the engine steps it predicts. `stoker/doctor/microbench.py` measures, `fit()` turns
the measurements into `Efficiencies`, `predict_step()` prices a step with `costmodel.step_cost`:

    gemm      the model's projection chain (every layer's qkv, o, gate_up, down: the weights the
              step streams, distinct per layer) at M tokens, less its fixed part (the same chain
              of 4 x L calls on near-empty weights: Python, ctypes, the parallel region's fork
              and join, which `overhead` already charges) -> e(M) = roofline floor / measured:
              the share of the roofline the matmuls reach at M rows (Efficiencies.gemm_compute
              and .memory both e(M), so the op keeps its bound and takes floor / e(M)).
              Between measured M, e is interpolated in log M.
    attention decode: all layers' paged attention over (B, context) from flushed caches (in a step a
              layer's KV was last read a whole step ago), less the same at one sequence
              of one block (the calls' fixed part, charged by `overhead`) -> .memory for KV streaming;
              prefill: causal attention over one prompt at two lengths -> .attention_compute,
              interpolated in log length (the causal kernel wastes less of each tile on longer
              prompts). Measured at shapes the sweep does not use: their scaling is predicted.
    row ops   every layer's row-wise work at M rows (residual + RMSNorm twice, rotary, K/V store,
              the attention output's copy; the embedding gather and final norm once), each layer
              on its own buffers as in the step, less the same at one row (that part is dispatch,
              counted by `overhead`): the activation traffic the roofline's matmul ops leave out
              (~4-7% of a long prefill).
    overhead  per-step host work (Python dispatch of every op, input tensors, sampling) and every
              call's fixed cost: a step of a model with the same layers and ops but almost no
              bytes or FLOPs, at the same batch and thread count, minus its own roofline floor,
              run on cold caches (step_timing.cold_host_step_seconds: a 4 MiB read before each
              projection, subtracted after): in a real step every projection streams MBs of
              weights between the host's ops, and the same host work took 2.8 ms there against
              1.7 ms in the probe with its 1.3 MB kept in L2 (B = 1, 1 thread).
              With T > 1 threads this is where each parallel region's wake-up of the other
              threads lands (OMP_WAIT_POLICY=PASSIVE: workers sleep between regions; on a 2-vCPU
              VM waking the idle vCPU added 5-125 us per region, ~41 regions a decode step), so
              the gemm and attention fits subtract their own fixed parts rather than count it
              twice. Prefill charges the batch-1 figure plus the host's per-token input building
              (`prepare_inputs` at M tokens less at one: Python lists of positions and slots).

Pure Python (no torch): roofline/ must stay importable without it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field

from stoker.roofline.costmodel import StepCost, step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec
from stoker.roofline.modelspec import ModelSpec

# A float32 CPU engine: weights, activations and LM head in 4 bytes, KV cache float32 too.
FP32 = {"weight_dtype": "fp32", "act_dtype": "fp32", "kv_dtype": "fp32", "last_token_logits": True}
PROJECTIONS = ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down")
_NO_GAPS = {"layer_overhead_s": 0.0, "step_overhead_s": 0.0}


@dataclass(frozen=True)
class Microbenchmarks:
    """Seconds measured on this machine (medians), the inputs of `fit`."""

    projection_chain_s: dict[int, float]  # tokens M -> one pass over every layer's projections
    decode_attention: tuple[int, int, float]  # (batch, context, seconds for all layers)
    prefill_attention_s: dict[int, float]  # prompt tokens -> seconds for all layers
    overhead_step_s: dict[int, float]  # decode batch -> seconds of the near-empty model's step
    overhead_floor_s: dict[int, float] = field(default_factory=dict)  # its own roofline floor, subtracted
    row_ops_s: dict[int, float] = field(default_factory=dict)  # tokens M -> all layers' row kernels (M = 1 included)
    # Fixed parts, subtracted before the fits (the overhead probe charges them once):
    chain_fixed_s: float = 0.0  # the projection chain's 4 x L calls on near-empty weights, one row
    decode_attention_fixed_s: float = 0.0  # all layers' decode attention at one sequence of one block
    host_inputs_s: dict[int, float] = field(default_factory=dict)  # tokens M -> building one prompt's inputs (M = 1 included)

    def __post_init__(self) -> None:
        if not self.projection_chain_s or not self.overhead_step_s:
            raise ValueError("need projection-chain and overhead measurements")
        if min(self.projection_chain_s.values()) <= 0 or min(self.overhead_step_s.values()) < 0:
            raise ValueError("measured seconds must be > 0")


@dataclass(frozen=True)
class MicroFit:
    device: GPUSpec  # the roofs the efficiencies are shares of (see `raise_roofs`)
    gemm_eff: dict[int, float]  # tokens M -> share of the roofline the projections reach
    attention_memory: float  # decode attention: share of the read bandwidth streaming KV
    attention_compute_eff: dict[int, float]  # prompt tokens -> prefill attention's share of the fp32 peak
    overhead_s: dict[int, float]  # decode batch -> host seconds per step
    row_ops_s: dict[int, float] = field(default_factory=dict)  # tokens M -> row kernels' seconds beyond M = 1
    host_tokens_s: dict[int, float] = field(default_factory=dict)  # prompt tokens M -> host input building beyond M = 1

    def attention_compute(self, prompt_len: int) -> float:
        return _interp_log(self.attention_compute_eff, prompt_len)

    def gemm_efficiency(self, tokens: int) -> float:
        return _interp_log(self.gemm_eff, tokens)

    def overhead(self, batch: int) -> float:
        return _interp_log(self.overhead_s, batch)


def _interp_log(table: dict[int, float], x: float) -> float:
    """Piecewise linear in log x through the table's points; flat beyond its ends."""
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    if x >= xs[-1]:
        return table[xs[-1]]
    i = bisect.bisect_right(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return table[x0] + w * (table[x1] - table[x0])


def _clamp(e: float) -> float:
    # Efficiencies must be in (0, 1]: a kernel beating the measured roof (a working set that
    # stayed in cache) is charged the roof itself.
    return min(1.0, max(e, 1e-6))


def _floor(model: ModelSpec, device: GPUSpec, phase: str, batch: int, context_len: int) -> StepCost:
    return step_cost(model, device, phase=phase, batch=batch, context_len=context_len,
                     eff=Efficiencies.ideal(), **FP32)  # type: ignore[arg-type]


def projection_floor_s(model: ModelSpec, device: GPUSpec, tokens: int) -> float:
    """Roofline floor of the projection chain at M tokens (what the microbenchmark times)."""
    s = _floor(model, device, "prefill", 1, tokens)
    return sum(op.time_s for op in s.floor_ops if op.name in PROJECTIONS)


def raise_roofs(model: ModelSpec, device: GPUSpec, mb: Microbenchmarks) -> GPUSpec:
    """The device with its fp32 peak and read bandwidth raised to the best rate any
    microbenchmark showed. A roof is what the machine can do; a peak measured during a burst of
    load from other jobs is not one, and efficiencies above 1 cannot be expressed. (The
    efficiencies are floor / measured, so the roofs cancel out of every prediction unless one
    had to be clamped: this is what keeps the check independent of when the peak was taken.)"""
    flops, nbytes = [device.peak_flops("fp32")], [device.hbm_bytes_per_s]
    for m, t in _chain_variable_s(mb).items():
        ops = [op for op in _floor(model, device, "prefill", 1, m).floor_ops if op.name in PROJECTIONS]
        flops.append(sum(op.flops for op in ops) / t)
        nbytes.append(sum(op.bytes for op in ops) / t)
    b, ctx, t_dec = _decode_attention_variable(mb)
    nbytes.append(_attention_op(_floor(model, device, "decode", b, ctx)).bytes / t_dec)
    for n, t in mb.prefill_attention_s.items():
        flops.append(_attention_op(_floor(model, device, "prefill", 1, n)).flops / t)
    return dataclasses.replace(device, fp32_tflops=max(flops) / 1e12, hbm_gb_per_s=max(nbytes) / 1e9)


def fit(model: ModelSpec, device: GPUSpec, mb: Microbenchmarks) -> MicroFit:
    """Efficiencies from microbenchmarks alone: each is a roofline floor over a measured time."""
    device = raise_roofs(model, device, mb)
    gemm = {m: _clamp(projection_floor_s(model, device, m) / t) for m, t in _chain_variable_s(mb).items()}
    b, ctx, t_dec = _decode_attention_variable(mb)
    dec = _attention_op(_floor(model, device, "decode", b, ctx))
    # Prefill attention's floor is its FLOPs at the fp32 peak (compute-bound: its bytes, K/V
    # written once and Q read, are a few % of that time): floor / measured is its compute share.
    attn_compute = {n: _clamp(_attention_op(_floor(model, device, "prefill", 1, n)).time_s / t)
                    for n, t in mb.prefill_attention_s.items()}
    overhead = {k: max(0.0, v - mb.overhead_floor_s.get(k, 0.0)) for k, v in mb.overhead_step_s.items()}
    rows = mb.row_ops_s
    row = {m: max(0.0, t - rows.get(1, t)) for m, t in rows.items()}
    host = {m: max(0.0, t - mb.host_inputs_s.get(1, t)) for m, t in mb.host_inputs_s.items()}
    return MicroFit(device, gemm, _clamp(dec.bytes / device.hbm_bytes_per_s / t_dec), attn_compute, overhead, row, host)


def _variable(t: float, fixed: float) -> float:
    # A fixed part above half the measurement would mean the two were taken in different
    # states of the machine (a burst of load on one): keep at least half rather than divide by
    # a difference of noise.
    return max(t - fixed, 0.5 * t)


def _chain_variable_s(mb: Microbenchmarks) -> dict[int, float]:
    return {m: _variable(t, mb.chain_fixed_s) for m, t in mb.projection_chain_s.items()}


def _decode_attention_variable(mb: Microbenchmarks) -> tuple[int, int, float]:
    b, ctx, t = mb.decode_attention
    return b, ctx, _variable(t, mb.decode_attention_fixed_s)


def _attention_op(s: StepCost):  # -> OpCost
    return next(op for op in s.floor_ops if op.op_class == "attention")


@dataclass(frozen=True)
class StepPrediction:
    phase: str
    batch: int
    context_len: int
    parts_s: dict[str, float]  # projections, lm_head, attention, overhead

    @property
    def step_time_s(self) -> float:
        return sum(self.parts_s.values())


def predict_step(model: ModelSpec, f: MicroFit, *, phase: str, batch: int, context_len: int) -> StepPrediction:
    """One engine step (decode: `batch` sequences at `context_len`; prefill: `batch` prompts of
    `context_len` tokens), priced by the cost model with the fitted efficiencies on the fit's roofs."""
    device = f.device
    tokens = batch if phase == "decode" else batch * context_len
    kw = dict(phase=phase, batch=batch, context_len=context_len, **FP32)
    e = f.gemm_efficiency(tokens)
    gemm = step_cost(model, device, eff=Efficiencies(gemm_compute=e, memory=e, **_NO_GAPS), **kw)  # type: ignore[arg-type]
    e_head = f.gemm_efficiency(batch)  # the LM head runs on one row per sequence
    head = step_cost(model, device, eff=Efficiencies(gemm_compute=e_head, memory=e_head, **_NO_GAPS), **kw)  # type: ignore[arg-type]
    attn = step_cost(model, device, eff=Efficiencies(attention_compute=f.attention_compute(context_len),
                                                     memory=f.attention_memory, **_NO_GAPS), **kw)  # type: ignore[arg-type]
    parts = {
        "projections": sum(op.time_s for op in gemm.ops if op.name in PROJECTIONS),
        "lm_head": sum(op.time_s for op in head.ops if op.name == "lm_head"),
        "attention": sum(op.time_s for op in attn.ops if op.op_class == "attention"),
        "row_ops": _interp_log(f.row_ops_s, tokens) if f.row_ops_s else 0.0,
        "overhead": f.overhead(batch) if phase == "decode" else
                    f.overhead(1) + (_interp_log(f.host_tokens_s, tokens) if f.host_tokens_s else 0.0),
    }
    return StepPrediction(phase, batch, context_len, parts)
