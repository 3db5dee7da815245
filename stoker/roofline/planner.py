"""Deployment planner: the cheapest way to serve a target rate under latency budgets.

Search space: weight dtype x KV dtype x TP degree x max batch x replicas. A candidate is
feasible when one GPU's weights + KV (max_batch x (prompt + output) tokens) + activations +
overhead fit in gpu_memory_utilization of its memory, and the cost model's TTFT and TPOT meet
the budgets. Replicas = ceil(target / one replica's rate).

Serving model of one replica at max_batch b (steady state, continuous batching with chunked
prefill, as vLLM V1 schedules): every step decodes b tokens at mean context prompt + output/2 and
has room for room = budget - b prompt tokens (max_num_batched_tokens, vLLM's 8192); b/output new
requests arrive per step, so a = b x prompt_len / output_len prompt tokens are prefilled per step,
in chunks of c = min(room, max(prompt_len, a)) tokens (prompts batched together, one forward per
chunk; not one batch-1 prefill per request):
    effective step = decode step + a / c x chunk step(c)
    rate = b / effective step;  TPOT = effective step;
    TTFT p50 ~ chunk steps of the prompt alone (chunks of min(room, prompt_len)) + one decode
    step per chunk.
The decode batch is capped by the KV capacity of the replica (kvcapacity.py: usable memory x
utilization - weights - activations - runtime buffers): b x (prompt + output) tokens must fit
in its blocks. Predictions use the "engine" efficiency profile unless told otherwise.
Cost per million tokens = GPUs x $/GPU-hour / (target tokens/s x 3600) x 1e6: you pay for every
GPU to serve the target, so the cheapest plan is the one with fewest GPUs (ties: most headroom).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from stoker.roofline.costmodel import step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GiB, GPUSpec, Interconnect, get_gpu, get_link
from stoker.roofline.kvcapacity import KVCapacity, kv_capacity
from stoker.roofline.memory import DEFAULT_MAX_NUM_BATCHED_TOKENS, vram
from stoker.roofline.modelspec import KV_DTYPES, ModelSpec, get_model_spec
from stoker.roofline.profiles import ENGINE
from stoker.roofline.workloads import chunked_prefill_s

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class PlanTargets:
    target_tokens_per_s: float
    ttft_p50_ms: float | None = None
    tpot_ms: float | None = None
    prompt_len: int = 1024
    output_len: int = 256
    max_gpus: int = 8
    gpu_hour_price: float = 1.0  # USD; at 1.0 the cost column reads as GPU-hours per million tokens
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # the scheduler's token budget per step

    def __post_init__(self) -> None:
        if self.target_tokens_per_s <= 0:
            raise ValueError("--target-tokens-per-s must be > 0")
        if self.max_num_batched_tokens < 2:
            raise ValueError("--max-num-batched-tokens must be >= 2")
        if self.prompt_len < 1 or self.output_len < 1 or self.max_gpus < 1:
            raise ValueError("--prompt-len, --output-len and --max-gpus must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu memory utilization must be in (0, 1]")


@dataclass(frozen=True)
class Candidate:
    gpus: int
    tp: int
    replicas: int
    weight_dtype: str
    kv_dtype: str
    max_batch: int
    tokens_per_s: float  # capacity of all replicas
    ttft_ms: float
    tpot_ms: float
    memory_per_gpu_gb: float  # GiB
    cost_per_million_tokens: float
    bound: str
    kv_capacity_tokens: int = 0  # per replica
    kv_max_seqs: int = 0  # sequences of prompt + output tokens the replica's KV holds at once

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Rejection:
    family: str
    tp: int
    weight_dtype: str
    kv_dtype: str
    reason: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    feasible: tuple[Candidate, ...]  # best max_batch per family, cheapest first
    rejected: tuple[Rejection, ...]

    def as_dict(self) -> dict[str, object]:
        return {"feasible": [c.as_dict() for c in self.feasible], "rejected": [r.as_dict() for r in self.rejected]}


def family_name(tp: int, weight_dtype: str, kv_dtype: str) -> str:
    return f"TP{tp} {weight_dtype} weights, {kv_dtype} KV"


def family_kv(m: ModelSpec, g: GPUSpec, t: PlanTargets, *, tp: int, weight_dtype: str, kv_dtype: str) -> KVCapacity:
    """KV capacity of one replica of a family (what caps its decode batch)."""
    return kv_capacity(m, g, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                       gpu_memory_utilization=t.gpu_memory_utilization, max_num_batched_tokens=t.max_num_batched_tokens)


def serving_times(m: ModelSpec, g: GPUSpec, t: PlanTargets, *, tp: int, weight_dtype: str, kv_dtype: str,
                  max_batch: int, link: Interconnect, eff: Efficiencies | None = None,
                  overlap_comm: bool = False) -> tuple[float, float, str]:
    """(effective step s, TTFT s, decode bound) of one replica at `max_batch` (module docstring)."""
    kw = dict(weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp, link=link, eff=eff, overlap_comm=overlap_comm)
    room = t.max_num_batched_tokens - max_batch  # prompt tokens one step can take
    arriving = max_batch * t.prompt_len / t.output_len  # prompt tokens to prefill per decode step
    # The scheduler takes a waiting prompt whole when it fits (chunks only what exceeds the room)
    # and batches prompts that wait together: chunks of min(room, max(prompt, arriving)) tokens.
    chunk = min(room, max(t.prompt_len, math.ceil(arriving)))
    decode = step_cost(m, g, batch=max_batch, context_len=t.prompt_len + t.output_len // 2, **kw)  # type: ignore[arg-type]
    prefill_per_step = chunked_prefill_s(m, g, prompt_tokens=arriving, prompt_len=t.prompt_len,
                                         chunk_tokens=chunk, **kw)  # type: ignore[arg-type]
    step = decode.step_time_s + prefill_per_step
    first_chunk = min(room, t.prompt_len)
    first = chunked_prefill_s(m, g, prompt_tokens=t.prompt_len, prompt_len=t.prompt_len, chunk_tokens=first_chunk, **kw)  # type: ignore[arg-type]
    ttft = first + math.ceil(t.prompt_len / first_chunk) * decode.step_time_s
    return step, ttft, decode.bound


def evaluate(m: ModelSpec, g: GPUSpec, t: PlanTargets, *, tp: int, weight_dtype: str, kv_dtype: str,
             max_batch: int, link: Interconnect, eff: Efficiencies | None = None,
             kv: KVCapacity | None = None, overlap_comm: bool = False) -> Candidate | str:
    """One (family, max_batch) point, replicas chosen to meet the target; a reason string if not."""
    kv = kv or family_kv(m, g, t, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    budget = kv.usable_bytes * t.gpu_memory_utilization
    if kv.weights_bytes > budget:
        return (f"weights {kv.weights_bytes * tp / GiB:.0f} GiB > {tp} x {kv.usable_bytes / GiB:.1f} GiB"
                f" x {t.gpu_memory_utilization:.2f} usable")
    seq_len = t.prompt_len + t.output_len
    seqs = kv.max_seqs(seq_len)
    if max_batch > seqs:
        return (f"batch {max_batch}: KV holds {seqs} sequences of {seq_len} tokens"
                f" ({kv.tokens:,} tokens, {kv.kv_bytes / GiB:.1f} GiB/GPU)")
    if max_batch >= t.max_num_batched_tokens:
        return f"batch {max_batch}: no room for prefill in a {t.max_num_batched_tokens}-token step budget"
    step, ttft, bound = serving_times(m, g, t, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                      max_batch=max_batch, link=link, eff=eff, overlap_comm=overlap_comm)
    ttft_ms, tpot_ms = ttft * 1e3, step * 1e3
    mem = vram(m, batch=max_batch, context_len=seq_len, weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp,
               max_num_batched_tokens=t.max_num_batched_tokens)
    if t.tpot_ms is not None and tpot_ms > t.tpot_ms:
        return f"batch {max_batch}: TPOT {tpot_ms:.1f} ms > budget {t.tpot_ms:g} ms"
    if t.ttft_p50_ms is not None and ttft_ms > t.ttft_p50_ms:
        return f"batch {max_batch}: TTFT {ttft_ms:.0f} ms > budget {t.ttft_p50_ms:g} ms"
    rate = max_batch / step
    replicas = math.ceil(t.target_tokens_per_s / rate)
    gpus = replicas * tp
    if gpus > t.max_gpus:
        return f"needs {gpus} GPUs ({replicas} replicas x TP{tp} at {rate:.0f} tokens/s each) > --max-gpus {t.max_gpus}"
    cost = gpus * t.gpu_hour_price / (t.target_tokens_per_s * 3600) * 1e6
    return Candidate(gpus, tp, replicas, weight_dtype, kv_dtype, max_batch, replicas * rate, ttft_ms, tpot_ms,
                     mem.total_bytes / GiB, cost, bound, kv.tokens, seqs)


# The weight dtypes a default plan searches for a float checkpoint (--quantization fp8|int8, or
# float): a plan prints the `stoker serve` command that runs it. int4 is served (tinygemm and a
# dequantizing path on GPUs, the C nibble kernel on CPUs) but online round-to-nearest int4 costs quality that 8-bit
# does not (ONLINE_INT4_QUALITY), so for a float checkpoint it is searched only when asked, as
# vLLM serves 4-bit only from a 4-bit checkpoint; a 4-bit checkpoint (AWQ, GPTQ,
# compressed-tensors W4A16) is planned as it ships (servable_weight_dtypes).
SERVABLE_WEIGHT_DTYPES = ("bf16", "fp8", "int8")
# Measured, not assumed (docs/quantization.md, "Quality of online int4"; tests/model/test_int4.py):
# teacher-forced over 256 positions against float32, on tiny random models (hidden 128, 2 layers),
# the worst case for round-to-nearest (Gaussian weights, no outliers); calibrated checkpoints do better.
ONLINE_INT4_QUALITY = ("online int4 (RTN, groups of 128) vs float: mean KL 0.18-0.22, top-1 agreement 0.42-0.51 "
                       "on tiny random models, the worst case (8-bit: KL 5.8e-4-8.0e-4, top-1 0.95-0.97; "
                       "docs/quantization.md)")
# int4 on a GPU (layers/int4_method.py's tinygemm form, bfloat16 models), measured on an H100
# (docs/benchmarks.md, "GPU: one NVIDIA H100"): batch-1 decode 1.73x bf16's, batch 8 1.07x; above
# 32 rows each layer is dequantized per call, 0.36x bf16 at batch 64. That form holds a bfloat16
# scale and zero per group (4 bytes) where the plan prices a float16 scale: 2 bytes a group more.
INT4_GPU_SPEED = ("int4 on GPUs: tinygemm decodes batch 1 at 1.73x bf16 (H100); above 32 rows each layer is "
                  "dequantized per call (0.36x bf16 at batch 64); bfloat16 models hold a bf16 scale and zero a "
                  "group there, 2 bytes a group more than priced")
# int4 experts (AWQ / GPTQ / W4A16 MoE checkpoints, --quantization int4 on a float MoE) are held
# 4-bit (layers/moe_int4.py); the backend is named with the plan, as for the dense int4 GEMM.
INT4_MOE_EXPERTS = ("int4 experts: held 4-bit, on CPU float32 the C MoE kernel dequantizing a panel per GEMM task, "
                    "elsewhere (GPUs included) each routed expert dequantized in torch per call (docs/moe.md)")
# A MoE model's experts take `--quantization fp8|int8` (layers/moe_quant.py) and 4-bit weights
# (layers/moe_int4.py), but a default MoE plan searches bf16 only, the precision of the walkthrough's
# MoE plans (docs/roofline.md); `--weight-dtypes` asks for the others.
MOE_SERVABLE_WEIGHT_DTYPES = ("bf16",)


def servable_weight_dtypes(m: ModelSpec) -> tuple[str, ...]:
    """The weight dtypes a default plan searches for `m`: what `stoker serve` runs for it. A checkpoint
    shipped quantized (DeepSeek-V3's and Kimi-K2's block-FP8, docs/mla.md; AWQ / GPTQ / W4A16 int4)
    is served as shipped."""
    if m.checkpoint_dtype:
        return (m.checkpoint_dtype,)
    return MOE_SERVABLE_WEIGHT_DTYPES if m.is_moe else SERVABLE_WEIGHT_DTYPES


def int4_note(m: ModelSpec) -> str:
    """What int4 weights cost for `m`, printed with a plan that searched them: the bytes (the
    engine's layout: half a byte a weight, a scale and, asymmetric, an offset per group) against
    bf16, and the quality: the measured figures for online int4, the checkpoint's own otherwise."""
    group = f"group of {m.int4_group_size}" if m.int4_group_size else "output row (per channel)"
    held = "a float16 scale" + ("" if m.int4_symmetric else " and a float32 offset")
    quality = ("the checkpoint's own calibration (not measured here; calibrated AWQ / GPTQ beat RTN)"
               if m.checkpoint_dtype == "int4" else ONLINE_INT4_QUALITY)
    return (f"int4 weights: {m.weight_bytes('int4') / GiB:.1f} GiB vs {m.weight_bytes('bf16') / GiB:.1f} GiB bf16 "
            f"(half a byte a weight + {held} per {group}, as the engine holds them); quality: {quality}; "
            f"{INT4_GPU_SPEED}")


def servable_kv_dtypes(m: ModelSpec) -> tuple[str, ...]:
    """KV dtypes the engine runs for `m`: an FP8 KV cache is refused with multi-head latent attention
    (docs/mla.md, "Refused"), so an MLA model is planned with a bf16 latent cache."""
    return ("bf16",) if m.is_mla else KV_DTYPES


def plan(model: ModelSpec | str, gpu: GPUSpec | str, targets: PlanTargets, *,
         link: Interconnect | str | None = None, weight_dtypes: tuple[str, ...] | None = None,
         kv_dtypes: tuple[str, ...] | None = None, tp_degrees: tuple[int, ...] = TP_DEGREES,
         batches: tuple[int, ...] = BATCHES, eff: Efficiencies | None = None, overlap_comm: bool = False) -> Plan:
    """Cheapest plans; `eff` None predicts with the "engine" profile (profiles.ENGINE); `weight_dtypes`
    None searches what the engine serves for the model (servable_weight_dtypes)."""
    eff = eff or ENGINE
    m = get_model_spec(model) if isinstance(model, str) else model
    weight_dtypes = weight_dtypes or servable_weight_dtypes(m)
    kv_dtypes = kv_dtypes or servable_kv_dtypes(m)
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    lnk = get_link(link) if isinstance(link, str) else (link or g.link)
    feasible: list[Candidate] = []
    rejected: list[Rejection] = []
    for tp in tp_degrees:
        for wd in weight_dtypes:
            for kvd in kv_dtypes:
                reason = _family_block(m, g, lnk, targets, tp)
                best: Candidate | None = None
                reasons: list[str] = []
                if reason is None:
                    kv = family_kv(m, g, targets, tp=tp, weight_dtype=wd, kv_dtype=kvd)
                    for b in batches:
                        c = evaluate(m, g, targets, tp=tp, weight_dtype=wd, kv_dtype=kvd, max_batch=b, link=lnk, eff=eff,
                                     kv=kv, overlap_comm=overlap_comm)
                        if isinstance(c, str):
                            reasons.append(c)
                        elif best is None or (c.gpus, -c.tokens_per_s) < (best.gpus, -best.tokens_per_s):
                            best = c
                    reason = _pick_reason(reasons)
                if best is not None:
                    feasible.append(best)
                else:
                    rejected.append(Rejection(family_name(tp, wd, kvd), tp, wd, kvd, reason or "no batch size fits"))
    feasible.sort(key=lambda c: (c.cost_per_million_tokens, -c.tokens_per_s))
    return Plan(tuple(feasible), tuple(rejected))


def _family_block(m: ModelSpec, g: GPUSpec, link: Interconnect, t: PlanTargets, tp: int) -> str | None:
    if tp > t.max_gpus:
        return f"TP{tp} > --max-gpus {t.max_gpus}"
    if m.num_heads % tp:
        return f"TP{tp} does not divide {m.num_heads} attention heads"
    if tp > 1 and link.kind == "none":
        return f"{g.name} has no GPU-GPU link for TP{tp}"
    return None


def _pick_reason(reasons: list[str]) -> str | None:
    """The most telling failure: the fewest GPUs some batch would need beats latency, latency
    beats memory (those mean some batch got close); among equals, the smallest batch's."""
    needs = [r for r in reasons if r.startswith("needs ")]
    if needs:
        return min(needs, key=lambda r: int(r.split()[1]))
    for marker in ("TTFT", "TPOT", "KV holds", "weights"):
        for r in reasons:
            if marker in r:
                return r
    return reasons[0] if reasons else None


# Weight dtypes the engine runs (`--quantization`), and the flag each needs.
_ENGINE_QUANTIZATION = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "int4"}


def serve_command(model: str, c: Candidate) -> str:
    """The `stoker serve` line that deploys one replica of candidate `c` (vLLM's flag names).
    `model` is shown as given when it is a checkpoint folder, else as a placeholder for one."""
    from pathlib import Path

    parts = ["stoker serve", model if Path(model).is_dir() else f"<{model} checkpoint folder>"]
    notes: list[str] = []  # what the engine cannot run yet: after the flags, as a shell comment
    try:
        spec: ModelSpec | None = get_model_spec(model)
    except ValueError:
        spec = None
    moe = spec is not None and spec.is_moe
    if spec is not None and spec.expert_dtype:
        # gpt-oss ships MXFP4 experts: the engine holds them 4-bit and dequantizes each routed expert in
        # torch (layers/moe_mxfp4.py), whole experts per rank only (docs/moe.md).
        notes.append(f"{spec.expert_dtype} experts: dequantized per expert in torch, not a fused kernel (docs/moe.md)")
    if moe and c.weight_dtype == "int4":
        notes.append(INT4_MOE_EXPERTS)
    if c.weight_dtype not in _ENGINE_QUANTIZATION:
        notes.append(f"{c.weight_dtype} weights: not in the engine yet (a pre-quantized {c.weight_dtype} checkpoint is needed)")
    elif spec is not None and spec.checkpoint_dtype == c.weight_dtype:
        # served as the checkpoint ships it (block-FP8, AWQ / GPTQ int4): its quantization_config says so, no flag
        if c.weight_dtype == "int4":
            notes.append(INT4_GPU_SPEED)
    elif _ENGINE_QUANTIZATION[c.weight_dtype]:
        parts.append(f"--quantization {_ENGINE_QUANTIZATION[c.weight_dtype]}")
        if c.weight_dtype == "int4":
            notes.append(f"{INT4_GPU_SPEED}; online int4 costs quality: mean KL 0.18-0.22 vs float on tiny random "
                         "models (docs/quantization.md)")
    if c.kv_dtype == "fp8":
        parts.append("--kv-cache-dtype fp8")
    parts.append(f"--max-num-seqs {c.max_batch}")
    if c.tp > 1:
        parts.append(f"--tensor-parallel-size {c.tp}")
        if spec is not None and spec.expert_dtype == "mxfp4":  # whole experts: any tp, where I / tp may split a 32-block
            parts.append("--enable-expert-parallel")
    if notes:
        parts.append("  # " + "; ".join(notes))
    return " ".join(parts)
