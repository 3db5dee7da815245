"""Roofline link: what decode MBU / MFU the measured throughput implies on named hardware.

Delegates to `stoker.roofline.measured.implied_utilization` (the roofline package owns the
hardware table and the cost model). The inputs we supply from a run, and why:
  output_tokens_per_s = output_throughput (output tokens only, prompt tokens excluded);
  batch               = mean requests in flight (Little's law: busy time / duration), the
                        average decode batch the server had to work with;
  context_len         = mean input + mean output / 2, the average KV length a decode step
                        reads over a request's life.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RooflineRequest:
    hardware: str
    model_config: str  # preset name or path to a config.json / checkpoint dir
    tensor_parallel_size: int = 1


def _implied_fn() -> Any:
    try:
        module = importlib.import_module("stoker.roofline.measured")
    except ModuleNotFoundError as exc:
        if exc.name in ("stoker.roofline.measured", "stoker.roofline"):
            raise ValueError("--hardware needs stoker.roofline.measured, which this checkout lacks; "
                             "drop --hardware") from None
        raise
    return module.implied_utilization


def check(req: RooflineRequest) -> None:
    """Fail before sending any load if the hardware or model config is unknown."""
    implied(req, output_tokens_per_s=1.0, batch=1.0, context_len=1.0)


def implied(req: RooflineRequest, *, output_tokens_per_s: float, batch: float,
            context_len: float) -> dict[str, Any]:
    fn = _implied_fn()
    try:
        out = fn(req.model_config, req.hardware, output_tokens_per_s=output_tokens_per_s,
                 batch=max(batch, 1.0), context_len=max(context_len, 1.0),
                 tp=req.tensor_parallel_size)
    except KeyError as exc:  # unknown GPU or preset names surface as KeyError in lookups
        raise ValueError(f"roofline: {exc.args[0] if exc.args else exc} (check --hardware and --model-config)") from None
    return dict(out)


def from_metrics(req: RooflineRequest, result: dict[str, Any]) -> dict[str, Any]:
    batch = float(result["mean_concurrency"])
    context = float(result["mean_input_len"]) + float(result["mean_output_len"]) / 2.0
    out = implied(req, output_tokens_per_s=float(result["output_throughput"]), batch=batch,
                  context_len=context)
    out.update({"model_config": req.model_config, "tensor_parallel_size": req.tensor_parallel_size,
                # what we passed in (the roofline rounds batch and context to whole numbers)
                "inputs": {"output_tokens_per_s": float(result["output_throughput"]),
                           "mean_concurrency": batch, "context_len": context}})
    return out
