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
            built with --enable_fp8 --fp8_kv_cache); A100 rows FP16. Both throughput tables report
            out tok/s *per GPU*: the H100 header says "out tok/s/GPU" at 138f96d and the A100 one
            does from commit 77d24b5 on, with the same numbers (at 138f96d it reads "out tok/s");
            TRT-LLM's XQA blog (docs/source/blogs/XQA-kernel.md) gives the definition,
            out_tps = output_seqlen x batch_size / total_latency / tp, total_latency being the
            whole generate (gptSessionBenchmark.cpp times session.generate(); gptSession.cpp runs
            step 0 as the context phase over every prompt, then output_len - 1 generation steps).
            So the group's figure is the table's x TP, and the prefill counts in the time.
            (Read at 138f96d as the TP group's figure, the A100 TP2/TP4 rows looked 1.8-5x slower
            than any roofline allows; per GPU, they sit where the H100 rows do.) "LLaMA 7B" /
            "LLaMA 70B" have the shapes of our llama-2-7b / llama-2-70b presets (the build commands'
            --n_layer/--n_head/--n_kv_head/--inter_size). First-token latency: "benchmark with a
            single output token" (performance.md), i.e. one generate() of output length 1.

MoE points (MOE_POINTS, issue 33; kept out of the engine-profile fit, which stays the dense fit
above, so they test it out of sample):
  GPT_FAST_MIXTRAL  github.com/pytorch-labs/gpt-fast mixtral-moe/README.md "Benchmarks" (table as of
            commit 48328fb, 2024-03-08, unchanged at 32971d3; the first version, 89b2502, had slower
            figures): the same 8 x A100-80GB at 330 W, batch 1, 5-token prompt as GPT_FAST. Its
            model.py gathers the k=2 picked experts' weights (`self.w1[expert_indices]`), so a step
            reads two experts per layer, as E x (1 - (1 - k/E)^1) = k says; GQA by repeat_interleave.
  VLLM_NIGHTLY  vLLM's nightly performance benchmark (buildkite.com/vllm/performance-benchmark),
            "Latency tests": input 32 tokens, output 128, batch fixed at 8, mean end-to-end latency
            of one generate (a static batch), Mixtral-8x7B at TP2 in its checkpoint's bf16; build
            9515 (H200, 1917.44 ms) and build 9523 (A100-SXM4-80GB, 3643.84 ms).
  TT_QWEN3  github.com/tenstorrent/tt-inference-server issue #340 "Qwen3 Family: GPU Benchmarks"
            (comment of 2025-07-18): Qwen3-30B-A3B on one A100 with vLLM, ISL 128 / OSL 128 at
            concurrency 1: TPOT 9.6 ms, "Tput Decode" 103.9 tok/s. Which A100 is not said; a bf16
            30.5B model needs the 80 GB one.
Seen and not added: gpt-oss-120b on one MI300X (SemiAnalysisAI/InferenceX PR #1061, vLLM 0.17,
1k/1k at concurrency 64-256): the cost model is 2.0-2.6x optimistic there, and vLLM's own MI300X
table (vllm-project/vllm PR #55934) shows two MXFP4 MoE backends 2x apart on the same model, so
which kernel ran, and at what share of the roofline, is not something the published point says.
Throughput tables run at "maximum load" (TensorRT-LLM perf-overview) give no batch size and are not
points the cost model can price.

Kinds of point:
  "decode"  steady decode of `batch` sequences at context input_len + output_len / 2; tokens/s.
  "static"  one static batch (workloads.static_batch_tokens_per_s); output tokens/s of the group.
  "ttft"    one prefill of `batch` x input_len tokens; seconds.
A point's `note` says why it misses when the cost model cannot say it (a kernel or a fixed cost
outside the roofline, with its source); the prediction is left as it is, not bent to the point.
`speed_ratio(point, eff)` is predicted speed / measured speed for every kind (> 1: the prediction
is optimistic), so one number reads the same way for throughput and latency points.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from dataclasses import dataclass

from stoker.roofline.costmodel import decode_tokens_per_s, step_cost, ttft_s
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec, get_gpu
from stoker.roofline.modelspec import ModelSpec, get_model_spec
from stoker.roofline.workloads import static_batch_tokens_per_s

GPT_FAST = "github.com/pytorch-labs/gpt-fast README.md#benchmarks (A100-80GB at 330 W)"
GPT_FAST_MIXTRAL = "github.com/pytorch-labs/gpt-fast mixtral-moe/README.md#benchmarks @48328fb (A100-80GB at 330 W)"
VLLM_NIGHTLY = "buildkite.com/vllm/performance-benchmark/builds/{build} Latency tests (vLLM nightly)"
TT_QWEN3 = "github.com/tenstorrent/tt-inference-server/issues/340 (Qwen3-30B-A3B on A100, vLLM, 2025-07-18)"
TRT_PERF = "github.com/NVIDIA/TensorRT-LLM docs/source/performance.md @138f96d"
KINDS = ("decode", "static", "ttft", "prefill")


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
    note: str = ""  # why the point misses, where something outside the cost model explains it
    # The engine's decode attention reads each KV head once per query head of its group, not once
    # per group (costmodel.kv_read_factor): a property of the measured engine's kernel, read from
    # its source (KV_READS below); changes nothing for an MHA model (llama-2-7b: groups of one).
    kv_per_query_head: bool = False
    # Expert-parallel deployments (DEEPSEEK_POINTS): the layout as the cost model's step_cost takes it;
    # figures of a "dp_attention" point are one rank's (one GPU). `link`: the link the all-to-all
    # crosses; `overlap_comm`: the engine overlaps communication with compute (two-batch overlap);
    # `expert_dtype`: the experts' storage dtype where the measured run quantized them on its own.
    ep: int = 1
    moe_scheme: str = "tp"
    redundant_experts: int = 0
    link: str | None = None
    overlap_comm: bool = False
    expert_dtype: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.measured <= 0:
            raise ValueError("measured must be > 0")


@functools.lru_cache(maxsize=None)
def _shapes(model: str, gpu: str) -> tuple[ModelSpec, GPUSpec]:
    # Resolved once per (preset, GPU): the fit prices every point thousands of times.
    return get_model_spec(model), get_gpu(gpu)


def predict(p: PublicPoint, eff: Efficiencies | None = None) -> float:
    """The cost model's figure for the point, in the point's own unit."""
    kw = dict(weight_dtype=p.weight_dtype, kv_dtype=p.kv_dtype, tp=p.tp, eff=eff)
    model, gpu = _shapes(p.model, p.gpu)
    if p.ep > 1 or p.kind == "prefill" or p.expert_dtype or p.link or p.overlap_comm:
        return _predict_layout(p, model, gpu, eff)
    if p.kind == "decode":
        return decode_tokens_per_s(model, gpu, batch=p.batch, context_len=p.input_len + p.output_len // 2,
                                   kv_per_query_head=p.kv_per_query_head, **kw)  # type: ignore[arg-type]
    if p.kind == "static":
        return static_batch_tokens_per_s(model, gpu, batch=p.batch, input_len=p.input_len,
                                         output_len=p.output_len, kv_per_query_head=p.kv_per_query_head, **kw)
    return ttft_s(model, gpu, p.input_len, **kw)  # type: ignore[arg-type]  # one context step: no decode reads


def _predict_layout(p: PublicPoint, model: ModelSpec, gpu: GPUSpec, eff: Efficiencies | None) -> float:
    """A point with a parallel layout of its own: decode tokens/s or prefill prompt tokens/s of one
    step of `batch` sequences (prefill: `batch` prompts of input_len tokens in one step)."""
    m = dataclasses.replace(model, expert_dtype=p.expert_dtype) if p.expert_dtype else model
    kw = dict(weight_dtype=p.weight_dtype, kv_dtype=p.kv_dtype, tp=p.tp, eff=eff, ep=p.ep, moe_scheme=p.moe_scheme,
              redundant_experts=p.redundant_experts, link=p.link, overlap_comm=p.overlap_comm, with_floor=False)
    if p.kind == "prefill":
        step = step_cost(m, gpu, phase="prefill", batch=1, context_len=p.input_len, chunk_tokens=p.batch * p.input_len,
                         **kw)  # type: ignore[arg-type]
        return p.batch * p.input_len / step.step_time_s
    if p.kind != "decode":
        raise ValueError(f"{p.label}: a layout point is a decode or prefill point, not {p.kind!r}")
    return step_cost(m, gpu, batch=p.batch, context_len=p.input_len + p.output_len // 2,
                     **kw).tokens_per_s  # type: ignore[arg-type]


def speed_ratio(p: PublicPoint, eff: Efficiencies | None = None) -> float:
    """Predicted / measured speed: tokens/s over tokens/s, or measured seconds over predicted."""
    pred = predict(p, eff)
    return p.measured / pred if p.kind == "ttft" else pred / p.measured


def ceiling_ratio(p: PublicPoint) -> float:
    """speed_ratio at the wall: datasheet peaks, no gaps, each cached K/V byte read once per step
    (a kernel that reads it once per query head may get the repeats from L2: the wall does not
    count them, as costmodel's floor does not). >= 1 for every point: the ceiling holds."""
    return speed_ratio(dataclasses.replace(p, kv_per_query_head=False), Efficiencies.ideal())


def summary(points: tuple[PublicPoint, ...] | list[PublicPoint], eff: Efficiencies | None = None,
            within: float = 0.25) -> dict[str, float]:
    """Median ratio, how many points land within +-`within` of the measurement, and the worst."""
    ratios = [speed_ratio(p, eff) for p in points]
    return {"n": len(ratios), "median_ratio": statistics.median(ratios),
            "within": sum(abs(r - 1) <= within for r in ratios),
            "worst_ratio": max(ratios, key=lambda r: abs(r - 1))}


def _gf(label: str, model: str, tp: int, wd: str, tps: float, held_out: bool = False, note: str = "") -> PublicPoint:
    return PublicPoint(label, model, "A100-80GB", tp, wd, "bf16", "decode", 1, 5, 190, tps, GPT_FAST, held_out, note,
                       kv_per_query_head=True)  # repeat_interleave before SDPA (KV_READS)


# KV_READS: how each engine's decode attention reads the KV cache of a grouped-query model (Llama-2-70B:
# 64 query heads, 8 KV heads), recorded per point as kv_per_query_head (costmodel.kv_read_factor).
#  * TensorRT-LLM v0.6.1 / v0.5 (the performance.md tables): the generation phase is "a single kernel,
#    called the masked multihead attention" with "a single CUDA thread-block per head"
#    (docs/source/gpt_attention.md "Generation Phase" @138f96d, the tables' commit; no other
#    generation kernel is documented there), and that kernel assigns "a threadblock for B x H pair",
#    H the query heads, each block loading its KV head's keys and values (decoderMaskedMultihead-
#    AttentionTemplate.h): each KV head is read once per query head of its group, 8x for 70B.
#    TensorRT-LLM's XQA kernel for MQA/GQA decode ("reducing data loading", blogs/XQA-kernel.md, in
#    v0.8 releases) measures 2.4x more Llama-70B 128/2048 throughput than without it.
#    Against this reading: performance.md at 77d24b5 (same numbers; its reproduction steps) says the
#    then-experimental XQA kernels "are not enabled by default" and its Llama2-70b commands start with
#    `export TRTLLM_ENABLE_XQA=1`. Which configurations v0.6.1's XQA served (FP8 KV cache on H100,
#    A100) is not published; with the per-query-head reading all seven 70B throughput rows land at
#    0.75-1.01, with the shared one at 1.00-2.05 (the three 2048-output rows 1.74-2.05x optimistic).
#  * gpt-fast (model.py): k and v are repeat_interleave'd to n_head heads before
#    scaled_dot_product_attention, so each KV head is read once per query head as well (immaterial
#    at batch 1 and ~100 tokens of context).
# Priced as HBM traffic: an upper bound (repeats may hit L2), which is why the rule leaves these rows
# on the pessimistic side; the ceiling (ceiling_ratio) counts one read. Nothing is fitted to it.
# TensorRT-LLM v0.5's first-token latency at 128 tokens: without a fixed cost the 2048-token rows
# fit and the 128-token rows were 1.56-1.84x optimistic: a fixed cost per context step growing with
# the layers, charged as Efficiencies.prefill_layer_overhead_s (what it is thought to be, with its
# source), one value for all GPUs. With the other knobs held, the rows imply ~115 us per layer (7B)
# to ~150 (70B TP4) on H100 and ~200-215 on A100; the fit settles near the A100 rows' value, which
# leaves the 7B H100 row at 128 tokens ~1.5x pessimistic.
TTFT_NOTE = ("per-layer context setup (v0.5 gptSession, prefill_layer_overhead_s) fitted as one value; these rows "
             "imply ~115-150 us per layer on H100, ~200-215 on A100")


def _trt(label: str, model: str, gpu: str, tp: int, batch: int, isl: int, osl: int, tps_per_gpu: float,
         held_out: bool = False, note: str = "") -> PublicPoint:
    # Both tables report out tok/s per GPU (see TRT_PERF above): x TP for the group.
    fp8 = gpu.upper().startswith("H100")
    return PublicPoint(label, model, gpu, tp, "fp8" if fp8 else "bf16", "fp8" if fp8 else "bf16", "static",
                       batch, isl, osl, tps_per_gpu * tp, TRT_PERF + (" Peak Throughput, H100 FP8" if fp8 else
                                                                " Peak Throughput, A100 FP16"), held_out, note,
                       kv_per_query_head=True)  # v0.6.1's masked MHA generation kernel (KV_READS)


def _ttft(label: str, model: str, gpu: str, tp: int, isl: int, ms: float, held_out: bool = False) -> PublicPoint:
    fp8 = gpu.upper().startswith("H100")
    return PublicPoint(label, model, gpu, tp, "fp8" if fp8 else "bf16", "fp8" if fp8 else "bf16", "ttft",
                       1, isl, 1, ms / 1e3, TRT_PERF + (" Low Latency, H100 FP8" if fp8 else " Low Latency, A100 FP16"),
                       held_out, TTFT_NOTE if isl <= 128 else "", kv_per_query_head=True)  # v0.5; no decode step


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
    # TensorRT-LLM v0.6.1 peak throughput, H100 FP8 (out tok/s/GPU; _trt multiplies by TP).
    _trt("TRT-LLM LLaMA-7B H100 fp8 b768 128/128", "llama-2-7b", "H100", 1, 768, 128, 128, 19694),
    _trt("TRT-LLM LLaMA-7B H100 fp8 b112 128/2048", "llama-2-7b", "H100", 1, 112, 128, 2048, 6818),
    _trt("TRT-LLM LLaMA-7B H100 fp8 b80 2048/128", "llama-2-7b", "H100", 1, 80, 2048, 128, 2244, held_out=True),
    _trt("TRT-LLM LLaMA-7B H100 fp8 b48 2048/2048", "llama-2-7b", "H100", 1, 48, 2048, 2048, 2740),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP2 b1024 128/128", "llama-2-70b", "H100", 2, 1024, 128, 128, 2657),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP4 b480 128/2048", "llama-2-70b", "H100", 4, 480, 128, 2048, 1486,
         held_out=True),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP2 b96 2048/128", "llama-2-70b", "H100", 2, 96, 2048, 128, 306),
    _trt("TRT-LLM LLaMA-70B H100 fp8 TP2 b64 2048/2048", "llama-2-70b", "H100", 2, 64, 2048, 2048, 547),
    # TensorRT-LLM v0.6.1 peak throughput, A100 FP16 (out tok/s/GPU as well: see TRT_PERF above).
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


# MoE points (see the module docstring): not in POINTS, so the engine profile is not fitted to them.
def _gf_moe(tp: int, wd: str, tps: float) -> PublicPoint:
    return PublicPoint(f"gpt-fast Mixtral-8x7B {wd} TP{tp}", "mixtral-8x7b", "A100-80GB", tp, wd, "bf16", "decode", 1, 5,
                       190, tps, GPT_FAST_MIXTRAL, kv_per_query_head=True)  # repeat_interleave before SDPA


def _vllm_latency(gpu: str, build: int, mean_ms: float) -> PublicPoint:
    # One generate of 8 prompts of 32 tokens, 128 out: output tokens of the batch over its latency.
    return PublicPoint(f"vLLM nightly Mixtral-8x7B {gpu} bf16 TP2 b8 32/128", "mixtral-8x7b", gpu, 2, "bf16", "bf16",
                       "static", 8, 32, 128, 8 * 128 / (mean_ms / 1e3), VLLM_NIGHTLY.format(build=build))


QWEN3_A100_NOTE = ("1.3x optimistic at batch 1 (1.6x before the MoE layer floor, moe_kernels.py): the step reads 8 "
                   "of 128 small experts (9.4 MB each) in each of 48 layers, and the A100's fused-MoE kernel loses "
                   "50 us per layer beyond those bytes in the one A100 kernel timing (vLLM #19049), where the "
                   "floor, the median over four GPUs, charges 29")

MOE_POINTS: tuple[PublicPoint, ...] = (
    _gf_moe(2, "bf16", 96.67),
    _gf_moe(4, "bf16", 155.35),
    _gf_moe(8, "bf16", 227.82),
    _gf_moe(1, "int8", 97.92),
    _gf_moe(2, "int8", 155.03),
    _gf_moe(4, "int8", 216.87),
    _gf_moe(8, "int8", 279.35),
    _vllm_latency("H200", 9515, 1917.44),
    _vllm_latency("A100-80GB", 9523, 3643.84),
    PublicPoint("tt-inference-server Qwen3-30B-A3B A100 bf16 b1 128/128", "qwen3-30b-a3b", "A100-80GB", 1, "bf16",
                "bf16", "decode", 1, 128, 128, 103.9, TT_QWEN3, note=QWEN3_A100_NOTE),
)

