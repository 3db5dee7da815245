"""Public end-to-end measurements of LLM engines, and the cost model's prediction for each.

These are the points the "engine" efficiency profile (profiles.py) is fitted to, and against which
docs/benchmarks.md ("Roofline predictions vs public measurements") reports the kernel-peak and
engine predictions. Every point names its source; nothing here is measured by this project.

Sources:
  GPT_FAST  github.com/pytorch-labs/gpt-fast README.md, "Benchmarks" (commit 0f925b5): 8 x A100-80GB
            power-limited to 330 W, batch 1, 5-token prompt, tokens/s of one sequence. int8 is
            weight-only. Decode context taken as ~100 tokens (immaterial at batch 1: the KV of 100
            tokens is <0.1% of the bytes per step).
  TRT_PERF  github.com/NVIDIA/TensorRT-LLM docs/source/performance.md (commit 138f96d), "Peak
            Throughput" (v0.6.1, gptSessionBenchmark: static batches) and "Low Latency" (v0.5, first
            token latency at batch 1). H100 rows are FP8 (weights, math and KV: the engines are
            built with --enable_fp8 --fp8_kv_cache) and report out tok/s *per GPU*; A100 rows are
            FP16 and report out tok/s of the whole TP group. "LLaMA 7B" / "LLaMA 70B" have the
            shapes of our llama-2-7b / llama-2-70b presets.

Kinds of point:
  "decode"  steady decode of `batch` sequences at context input_len + output_len / 2; tokens/s.
  "static"  one static batch (workloads.static_batch_tokens_per_s); output tokens/s of the group.
  "ttft"    one prefill of `batch` x input_len tokens; seconds.
`speed_ratio(point, eff)` is predicted speed / measured speed for every kind (> 1: the prediction
is optimistic), so one number reads the same way for throughput and latency points.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from stoker.roofline.costmodel import decode_tokens_per_s, ttft_s
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.workloads import static_batch_tokens_per_s

GPT_FAST = "github.com/pytorch-labs/gpt-fast README.md#benchmarks (A100-80GB at 330 W)"
TRT_PERF = "github.com/NVIDIA/TensorRT-LLM docs/source/performance.md @138f96d"
KINDS = ("decode", "static", "ttft")


@dataclass(frozen=True)
class PublicPoint:
    label: str
    model: str  # preset name (modelspec)
    gpu: str
    tp: int
    weight_dtype: str
    kv_dtype: str
    kind: str  # "decode" | "static" | "ttft"
    batch: int
    input_len: int
    output_len: int
    measured: float  # output tokens/s of the TP group (decode, static) or seconds (ttft)
    source: str
    held_out: bool = False  # True: kept out of the engine-profile fit, used to report its error

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.measured <= 0:
            raise ValueError("measured must be > 0")


def predict(p: PublicPoint, eff: Efficiencies | None = None) -> float:
    """The cost model's figure for the point, in the point's own unit."""
    kw = dict(weight_dtype=p.weight_dtype, kv_dtype=p.kv_dtype, tp=p.tp, eff=eff)
    if p.kind == "decode":
        return decode_tokens_per_s(p.model, p.gpu, batch=p.batch, context_len=p.input_len + p.output_len // 2, **kw)  # type: ignore[arg-type]
    if p.kind == "static":
        return static_batch_tokens_per_s(p.model, p.gpu, batch=p.batch, input_len=p.input_len,
                                         output_len=p.output_len, **kw)
    return ttft_s(p.model, p.gpu, p.input_len, **kw)  # type: ignore[arg-type]


def speed_ratio(p: PublicPoint, eff: Efficiencies | None = None) -> float:
    """Predicted / measured speed: tokens/s over tokens/s, or measured seconds over predicted."""
    pred = predict(p, eff)
    return p.measured / pred if p.kind == "ttft" else pred / p.measured


def summary(points: tuple[PublicPoint, ...] | list[PublicPoint], eff: Efficiencies | None = None,
            within: float = 0.25) -> dict[str, float]:
    """Median ratio, how many points land within +-`within` of the measurement, and the worst."""
    ratios = [speed_ratio(p, eff) for p in points]
    return {"n": len(ratios), "median_ratio": statistics.median(ratios),
            "within": sum(abs(r - 1) <= within for r in ratios),
            "worst_ratio": max(ratios, key=lambda r: abs(r - 1))}


def _gf(label: str, model: str, tp: int, wd: str, tps: float, held_out: bool = False) -> PublicPoint:
    return PublicPoint(label, model, "A100-80GB", tp, wd, "bf16", "decode", 1, 5, 190, tps, GPT_FAST, held_out)


def _trt(label: str, model: str, gpu: str, tp: int, batch: int, isl: int, osl: int, tps_group: float,
         held_out: bool = False) -> PublicPoint:
    fp8 = gpu.upper().startswith("H100")
    return PublicPoint(label, model, gpu, tp, "fp8" if fp8 else "bf16", "fp8" if fp8 else "bf16", "static",
                       batch, isl, osl, tps_group, TRT_PERF + (" Peak Throughput, H100 FP8" if fp8 else
                                                               " Peak Throughput, A100 FP16"), held_out)


def _ttft(label: str, model: str, gpu: str, tp: int, isl: int, ms: float, held_out: bool = False) -> PublicPoint:
    fp8 = gpu.upper().startswith("H100")
    return PublicPoint(label, model, gpu, tp, "fp8" if fp8 else "bf16", "fp8" if fp8 else "bf16", "ttft",
                       1, isl, 1, ms / 1e3, TRT_PERF + (" Low Latency, H100 FP8" if fp8 else " Low Latency, A100 FP16"),
                       held_out)


# Every third point (by position in each source's table) is held out of the fit.
POINTS: tuple[PublicPoint, ...] = (
    # gpt-fast, batch 1 decode, A100-80GB at 330 W (Tokens/Second column).
    _gf("gpt-fast Llama-2-7B bf16 TP1", "llama-2-7b", 1, "bf16", 104.9),
    _gf("gpt-fast Llama-2-7B bf16 TP2", "llama-2-7b", 2, "bf16", 168.84),
    _gf("gpt-fast Llama-2-7B bf16 TP4", "llama-2-7b", 4, "bf16", 254.02, held_out=True),
    _gf("gpt-fast Llama-2-7B bf16 TP8", "llama-2-7b", 8, "bf16", 328.43),
    _gf("gpt-fast Llama-2-70B bf16 TP2", "llama-2-70b", 2, "bf16", 21.32),
    _gf("gpt-fast Llama-2-70B bf16 TP4", "llama-2-70b", 4, "bf16", 38.01, held_out=True),
    _gf("gpt-fast Llama-2-70B bf16 TP8", "llama-2-70b", 8, "bf16", 62.50),
    _gf("gpt-fast Llama-2-7B int8 TP1", "llama-2-7b", 1, "int8", 155.58),
    _gf("gpt-fast Llama-2-70B int8 TP1", "llama-2-70b", 1, "int8", 19.13, held_out=True),
    _gf("gpt-fast Llama-2-70B int8 TP8", "llama-2-70b", 8, "int8", 80.44),
    # TensorRT-LLM v0.6.1 peak throughput, H100 FP8 (table is per GPU: x TP for the group).
    _trt("TRT-LLM LLaMA-7B H100 fp8 b768 128/128", "llama-2-7b", "H100", 1, 768, 128, 128, 19694),
    _trt("TRT-LLM LLaMA-7B H100 fp8 b112 128/2048", "llama-2-7b", "H100", 1, 112, 128, 2048, 6818),
    _trt("TRT-LLM LLaMA-7B H100 fp8 b80 2048/128", "llama-2-7b", "H100", 1, 80, 2048, 128, 2244, held_out=True),
    _trt("TRT-LLM LLaMA-7B H100 fp8 b48 2048/2048", "llama-2-7b", "H100", 1, 48, 2048, 2048, 2740),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP2 b1024 128/128", "llama-2-70b", "H100", 2, 1024, 128, 128, 2 * 2657),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP4 b480 128/2048", "llama-2-70b", "H100", 4, 480, 128, 2048, 4 * 1486,
         held_out=True),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP2 b96 2048/128", "llama-2-70b", "H100", 2, 96, 2048, 128, 2 * 306),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP2 b64 2048/2048", "llama-2-70b", "H100", 2, 64, 2048, 2048, 2 * 547),
    # TensorRT-LLM v0.6.1 peak throughput, A100 FP16 (table is per TP group).
    _trt("TRT-LLM LLaMA-7B A100 fp16 b384 128/128", "llama-2-7b", "A100-80GB", 1, 384, 128, 128, 5586, held_out=True),
    _trt("TRT-LLM LLaMA-7B A100 fp16 b60 128/2048", "llama-2-7b", "A100-80GB", 1, 60, 128, 2048, 1928),
    _trt("TRT-LLM LLaMA-7B A100 fp16 b52 2048/128", "llama-2-7b", "A100-80GB", 1, 52, 2048, 128, 591),
    _trt("TRT-LLM LLaMA-7B A100 fp16 TP2 b64 2048/2048", "llama-2-7b", "A100-80GB", 2, 64, 2048, 2048, 782,
         held_out=True),
    _trt("TRT-LLM LLaMA-70B A100 fp16 TP4 b1280 128/128", "llama-2-70b", "A100-80GB", 4, 1280, 128, 128, 670),
    _trt("TRT-LLM LLaMA-70B A100 fp16 TP4 b240 128/2048", "llama-2-70b", "A100-80GB", 4, 240, 128, 2048, 525),
    _trt("TRT-LLM LLaMA-70B A100 fp16 TP4 b120 2048/128", "llama-2-70b", "A100-80GB", 4, 120, 2048, 128, 79,
         held_out=True),
    # TensorRT-LLM v0.5 first-token latency, batch 1.
    _ttft("TRT-LLM LLaMA-7B H100 fp8 TTFT 128", "llama-2-7b", "H100", 1, 128, 7),
    _ttft("TRT-LLM LLaMA-7B H100 fp8 TTFT 2048", "llama-2-7b", "H100", 1, 2048, 36),
    _ttft("TRT-LLM LLaMA-70B H100 fp8 TP4 TTFT 128", "llama-2-70b", "H100", 4, 128, 26, held_out=True),
    _ttft("TRT-LLM LLaMA-70B H100 fp8 TP4 TTFT 2048", "llama-2-70b", "H100", 4, 2048, 109),
    _ttft("TRT-LLM LLaMA-7B A100 fp16 TTFT 128", "llama-2-7b", "A100-80GB", 1, 128, 16),
    _ttft("TRT-LLM LLaMA-7B A100 fp16 TTFT 2048", "llama-2-7b", "A100-80GB", 1, 2048, 133, held_out=True),
    _ttft("TRT-LLM LLaMA-70B A100 fp16 TP4 TTFT 128", "llama-2-70b", "A100-80GB", 4, 128, 47),
    _ttft("TRT-LLM LLaMA-70B A100 fp16 TP4 TTFT 2048", "llama-2-70b", "A100-80GB", 4, 2048, 377),
)


def fit_points() -> tuple[PublicPoint, ...]:
    return tuple(p for p in POINTS if not p.held_out)


def held_out_points() -> tuple[PublicPoint, ...]:
    return tuple(p for p in POINTS if p.held_out)
