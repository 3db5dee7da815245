"""Measured runs against the roofline: MBU, MFU and the share of the wall a run reached.

    implied_utilization("llama-3-8b", "h100", output_tokens_per_s=150, batch=1, context_len=512)
    load_measured("result.json", batch=None, context_len=None) -> MeasuredRun

MBU = (weight bytes + KV bytes read) / time per output token / peak bandwidth; MFU = achieved
FLOP/s / peak FLOP/s (Databricks, "LLM inference performance engineering: best practices", via
facts.md). Both are per GPU of the TP group, against datasheet peaks.

Result files: a `stoker bench serve` result (vLLM `bench serve` keys: output_throughput,
max_concurrency, mean_tpot_ms, total_input_tokens, completed, model_id, hardware, ...) or the
offline throughput JSON (num_prompts, input_len, output_len, elapsed_s, model). Both carry
output_throughput, total_token_throughput and request_throughput.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.roofline.costmodel import compute_dtype, step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import get_gpu

DEFAULT_OFFLINE_MAX_NUM_SEQS = 256  # vLLM's max_num_seqs default for offline runs


def implied_utilization(model: str, gpu: str, *, output_tokens_per_s: float, batch: float, context_len: float,
                        tp: int = 1, weight_dtype: str = "bf16", kv_dtype: str | None = None,
                        eff: Efficiencies | None = None) -> dict[str, float]:
    """What a measured decode rate implies: bandwidth and FLOP/s achieved per GPU, MBU, MFU,
    and the model's prediction and ceiling for the same point."""
    if output_tokens_per_s <= 0:
        raise ValueError("output_tokens_per_s must be > 0")
    b = max(1, round(batch))
    step = step_cost(model, gpu, batch=b, context_len=max(1, round(context_len)), tp=tp,
                     weight_dtype=weight_dtype, kv_dtype=kv_dtype, eff=eff)
    g = get_gpu(gpu)
    step_time = b / output_tokens_per_s  # one decode step emits one token per sequence
    gb_per_s = step.bytes / step_time / 1e9
    tflops = step.flops / step_time / 1e12
    return {
        "batch": b,
        "context_len": round(context_len),
        "measured_tokens_per_s": output_tokens_per_s,
        "measured_step_time_s": step_time,
        "achieved_gb_per_s": gb_per_s,
        "achieved_tflops": tflops,
        "mbu": gb_per_s * 1e9 / g.hbm_bytes_per_s,
        "mfu": tflops * 1e12 / g.peak_flops(compute_dtype(weight_dtype, g)),
        "predicted_tokens_per_s": step.tokens_per_s,
        "ceiling_tokens_per_s": step.ceiling_tokens_per_s,
        "fraction_of_ceiling": output_tokens_per_s / step.ceiling_tokens_per_s,
        "prediction_error": step.tokens_per_s / output_tokens_per_s - 1,
    }


@dataclass(frozen=True)
class MeasuredRun:
    output_tokens_per_s: float
    batch: float
    context_len: float
    model: str | None
    gpu: str | None
    kind: str  # "serve" | "offline"
    assumptions: tuple[str, ...]
    tp: int | None = None


def _read(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = Path(path_or_dict)
    if not path.is_file():
        raise FileNotFoundError(f"no result file at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected one JSON object (a bench result)")
    return data


def load_measured(path_or_dict: str | Path | dict[str, Any], *, batch: float | None = None,
                  context_len: float | None = None) -> MeasuredRun:
    """Read either result shape. `batch`/`context_len` (the CLI's flags) fill in what the file
    does not say; every value not read from the file is listed in `assumptions`."""
    d = _read(path_or_dict)
    flag_batch, flag_context = batch, context_len
    batch = context_len = None
    if "output_throughput" not in d:
        raise ValueError("result has no 'output_throughput' (output tokens/s); is it a stoker bench result?")
    out_tps = float(d["output_throughput"])
    notes: list[str] = []
    kind = "offline" if "elapsed_s" in d or "input_len" in d else "serve"
    # context: file first, then the flag, then a stated default
    completed = d.get("completed") or d.get("num_prompts")
    if kind == "offline" and d.get("input_len") is not None and d.get("output_len") is not None:
        context_len = float(d["input_len"]) + float(d["output_len"]) / 2
        notes.append(f"context {context_len:.0f} = input_len + output_len/2 (mean over a sequence's decode)")
    elif completed and d.get("total_input_tokens") is not None and d.get("total_output_tokens") is not None:
        context_len = (float(d["total_input_tokens"]) + float(d["total_output_tokens"]) / 2) / float(completed)
        notes.append(f"context {context_len:.0f} = mean prompt + half the mean output, from the result's token totals")
    elif flag_context is not None:
        context_len = float(flag_context)
        notes.append(f"context {context_len:.0f} from --context (not in the file)")
    else:
        context_len = 1024.0
        notes.append("context 1024 assumed (not in the file; pass --context)")
    # batch: file first, then the flag, then a stated default
    if d.get("max_concurrency"):
        batch = float(d["max_concurrency"])
        notes.append(f"batch {batch:.0f} = max_concurrency from the file")
    elif d.get("mean_tpot_ms"):
        # Little's law over decode: each running sequence emits one token per TPOT.
        batch = out_tps * float(d["mean_tpot_ms"]) / 1000
        notes.append(f"batch {batch:.1f} = output_throughput x mean_tpot (Little's law; pass --batch to override)")
    elif kind == "offline" and flag_batch is not None:
        batch = float(flag_batch)
        notes.append(f"batch {batch:.0f} from --batch (the offline result does not record it)")
    elif kind == "offline" and d.get("num_prompts"):
        batch = float(min(int(d["num_prompts"]), DEFAULT_OFFLINE_MAX_NUM_SEQS))
        notes.append(f"batch {batch:.0f} = min(num_prompts, max_num_seqs {DEFAULT_OFFLINE_MAX_NUM_SEQS}) assumed")
    elif flag_batch is not None:
        batch = float(flag_batch)
        notes.append(f"batch {batch:.0f} from --batch (not in the file)")
    else:
        batch = 1.0
        notes.append("batch 1 assumed (not in the file; pass --batch)")
    model = d.get("model_id") or d.get("model")
    gpu = d.get("hardware") or d.get("gpu")
    tp = d.get("tensor_parallel_size") or d.get("tp")
    return MeasuredRun(out_tps, float(batch), float(context_len), model, gpu, kind, tuple(notes),
                       int(tp) if tp else None)
