"""Plain-text tables and the plain-language verdict for `stoker roofline`."""

from __future__ import annotations

from stoker.roofline.costmodel import StepCost
from stoker.roofline.lora import LoRASpec, adapter_params
from stoker.roofline.modelspec import ModelSpec, dtype_bytes


def wall_shares(step: StepCost) -> dict[str, float]:
    """Share of step time spent on each wall: weight reads, KV reads, other memory traffic,
    arithmetic, collectives, launch gaps. A memory-bound op's time is split by its bytes."""
    shares = {"weight reads": 0.0, "KV reads": 0.0, "activation traffic": 0.0, "arithmetic": 0.0,
              "collectives": 0.0, "launch gaps": 0.0}
    for op in step.ops:
        if op.bound == "memory" and op.bytes:
            shares["weight reads"] += op.time_s * op.weight_bytes / op.bytes
            shares["KV reads"] += op.time_s * op.kv_bytes / op.bytes
            shares["activation traffic"] += op.time_s * (op.bytes - op.weight_bytes - op.kv_bytes) / op.bytes
        elif op.bound == "compute":
            shares["arithmetic"] += op.time_s
        elif op.bound == "communication":
            shares["collectives"] += op.time_s
        else:
            shares["launch gaps"] += op.time_s
    total = step.step_time_s
    return {k: v / total for k, v in shares.items()}


def step_header(s: StepCost) -> str:
    what = f"{s.batch} x {s.context_len}-token prompts" if s.phase == "prefill" else \
        f"batch {s.batch}, context {s.context_len}"
    return (f"{s.phase} {what}, TP{s.tp} {s.weight_dtype} weights / {s.kv_dtype} KV on {s.gpu}: "
            f"step {s.step_time_s * 1e3:.2f} ms, {s.tokens_per_s:,.0f} tokens/s, {s.bound}-bound "
            f"(floor {s.latency_floor_s * 1e3:.2f} ms)")


def ops_table(s: StepCost) -> str:
    rows = [f"  {'op':<13}{'GFLOP':>10}{'MB':>11}{'FLOP/B':>9}{'time ms':>10}{'share':>7}  bound"]
    for op in s.ops:
        rows.append(f"  {op.name:<13}{op.flops / 1e9:>10.1f}{op.bytes / 1e6:>11.1f}{op.arithmetic_intensity:>9.1f}"
                    f"{op.time_s * 1e3:>10.3f}{op.time_s / s.step_time_s:>7.0%}  {op.bound}")
    return "\n".join(rows)


def summary_table(steps: list[StepCost]) -> str:
    rows = [f"{'batch':>6}{'step ms':>10}{'tokens/s':>11}{'tok/s/GPU':>11}{'ceiling':>10}{'floor ms':>10}"
            f"{'FLOP/B':>8}  bound"]
    for s in steps:
        rows.append(f"{s.batch:>6}{s.step_time_s * 1e3:>10.2f}{s.tokens_per_s:>11,.0f}{s.tokens_per_s / s.tp:>11,.0f}"
                    f"{s.ceiling_tokens_per_s:>10,.0f}{s.latency_floor_s * 1e3:>10.2f}{s.arithmetic_intensity:>8.1f}"
                    f"  {s.bound}")
    return "\n".join(rows)


def verdict(steps: list[StepCost], ridge_batch: int | None, ridge_point: float) -> list[str]:
    """One sentence on the first batch's wall, one on what the sweep buys."""
    first = steps[0]
    shares = wall_shares(first)
    wall, share = max(shares.items(), key=lambda kv: kv[1])
    unit = "ms/token" if first.phase == "decode" else "ms per prefill"
    what = f"batch {first.batch}" if first.phase == "decode" else f"{first.batch} x {first.context_len} tokens"
    lines = [f"{first.phase} at {what} is {first.bound}-bound: {share:.0%} of step time is {wall}; "
             f"floor {first.latency_floor_s * 1e3:.1f} {unit} (predicted {first.step_time_s * 1e3:.1f})."]
    if len(steps) > 1 and first.phase == "decode":
        last = steps[-1]
        gain = last.tokens_per_s / first.tokens_per_s
        where = ("before the ridge" if ridge_batch is None or last.batch < ridge_batch else "past the ridge")
        ridge = (f"weight matmuls cross the ridge ({ridge_point:.0f} FLOP/B) at batch ~{ridge_batch}"
                 if ridge_batch else "weight matmuls never cross the ridge in range")
        lines.append(f"batch {last.batch} raises throughput {gain:.1f}x {where} "
                     f"(per-token latency {first.step_time_s * 1e3:.1f} -> {last.step_time_s * 1e3:.1f} ms); {ridge}.")
    return lines


def measured_lines(util: dict[str, float], assumptions: tuple[str, ...]) -> list[str]:
    lines = [f"measured {util['measured_tokens_per_s']:,.0f} tokens/s at batch {util['batch']}, context "
             f"{util['context_len']}: MBU {util['mbu']:.0%} ({util['achieved_gb_per_s']:,.0f} GB/s per GPU), "
             f"MFU {util['mfu']:.1%} ({util['achieved_tflops']:.1f} TFLOP/s per GPU); "
             f"{util['fraction_of_ceiling']:.0%} of the roofline ceiling ({util['ceiling_tokens_per_s']:,.0f} tokens/s); "
             f"model predicts {util['predicted_tokens_per_s']:,.0f}."]
    lines += [f"  assumed: {a}" for a in assumptions]
    return lines


def lora_summary(lora: LoRASpec, spec: ModelSpec, with_lora: StepCost, base: StepCost,
                 act_dtype: str = "bf16") -> dict[str, float]:
    """The adapters' extra work in one step (per GPU) beside the same step without them: weights
    read per step, FLOPs per token, each as a share of the base's, and both step times."""
    op = next(o for o in with_lora.ops if o.name == "lora")
    tokens = with_lora.tokens_per_step
    params = adapter_params(spec, lora.rank, lora.targets, with_lora.tp)
    return {"batch": base.batch, "rank": lora.rank, "max_loras": lora.max_loras,
            "adapters_in_step": lora.adapters_in_step(base.batch),
            "params_per_adapter": params, "bytes_per_adapter": params * dtype_bytes(act_dtype),
            "weight_bytes_per_step": op.weight_bytes, "bytes_per_step": op.bytes,
            "weight_bytes_share": op.weight_bytes / base.weight_bytes,
            "flops_per_token": op.flops / tokens, "flops_per_token_share": op.flops / base.flops,
            "base_step_time_s": base.step_time_s, "step_time_s": with_lora.step_time_s}


def lora_table(lora: LoRASpec, rows: list[dict[str, float]], act_dtype: str = "bf16") -> str:
    """`stoker roofline --lora-rank R --max-loras N`: what the adapters add per step, per batch."""
    first = rows[0]
    head = (f"LoRA: rank {lora.rank} on {','.join(lora.targets)}, up to {lora.max_loras} adapter"
            f"{'s' if lora.max_loras > 1 else ''} a step (one per sequence): {first['params_per_adapter'] / 1e6:,.2f}M "
            f"params per adapter per GPU ({first['bytes_per_adapter'] / 1e6:,.1f} MB in {act_dtype})")
    # Weights: each adapter in the step read once. Traffic: those weights + the updates' activations
    # (the shrink reads x again, the expand adds into the output), what dominates a long prefill.
    out = [head, f"{'batch':>6}{'adapters':>10}{'weights MB':>12}{'of base weights':>17}{'traffic MB':>12}"
                 f"{'MFLOP/token':>13}{'of base FLOPs':>15}{'step ms base -> LoRA':>23}"]
    for r in rows:
        out.append(f"{r['batch']:>6}{r['adapters_in_step']:>10}{r['weight_bytes_per_step'] / 1e6:>12,.1f}"
                   f"{r['weight_bytes_share']:>17.2%}{r['bytes_per_step'] / 1e6:>12,.1f}"
                   f"{r['flops_per_token'] / 1e6:>13,.1f}{r['flops_per_token_share']:>15.2%}"
                   f"{r['base_step_time_s'] * 1e3:>12.2f} -> {r['step_time_s'] * 1e3:.2f}")
    return "\n".join(out)
