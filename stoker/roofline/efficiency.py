"""Achievable share of peak, per op class: the knobs between the roofline wall and a real run.

The cost model's *ceiling* uses `Efficiencies.ideal()` (every share 1, no overhead); its
*prediction* uses the defaults below. `calibrate.calibrate(bench_json)` fits them to measured
decode runs, so every default here is a starting point with a source, not a promise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiencies:
    # Matmuls (qkv/o/mlp/lm_head): share of dense peak FLOP/s. facts.md: a bf16 8192^3 matmul
    # runs at ~770-790 of 989 TFLOP/s on the H200 lent to this project (~0.79).
    gemm_compute: float = 0.78
    # Matmuls on 8-bit tensor cores (FP8, and W8A8 INT8), when it differs: 0 means "same as
    # gemm_compute" (the default, so every older profile and caller keeps its numbers). FP8 GEMMs
    # reach a lower share of their (2x) datasheet peak than BF16 ones: vLLM's bench_fp8_gemm on an
    # H100 (github.com/vllm-project/vllm/pull/49363, gemma N=12288 K=5376, M=128) gives 506 TFLOP/s
    # FP8 with activation quantization vs 353 BF16, 1.4x where the datasheet says 2x; Databricks'
    # FP8 training MFU on H100 is below its BF16 MFU for the same reason (scaling-factor work,
    # github.com/NVIDIA/TransformerEngine/issues/1151). INT8 W8A8 shares it: the same 2x rate, the
    # same activation quantization and scales (an assumption: the public points are all FP8; with
    # one share for 16-bit and another for FP8 only, INT8 would price as the faster 8-bit choice
    # for no reason). The engine profile fits it on FP8 points.
    gemm_compute_8bit: float = 0.0
    # Attention math: FlashAttention-2 reaches 50-73% of A100 peak in the forward pass
    # (Dao 2023, arXiv:2307.08691, fig. 4); decode attention is rarely compute-bound anyway.
    attention_compute: float = 0.5
    # Weight and KV streaming: share of datasheet HBM bandwidth. facts.md: device-to-device copy
    # ~4.3 of 4.8 TB/s on H200 (0.90); gpt-fast's README: "empirically peak bandwidth is about
    # 1700 GB/s" on a 2039 GB/s A100 (0.83). Small decode GEMVs stream a little below a copy.
    memory: float = 0.82
    # Collectives: share of per-direction link bandwidth. NCCL gets ~370 of NVLink4's 450 GB/s
    # (sjeaugey, github.com/NVIDIA/nccl-tests/issues/212): 0.82.
    comm: float = 0.82
    # Launch gaps: seconds lost per decoder layer per step between kernels (CUDA-graph replay
    # still leaves ~1-2 us per kernel and a layer runs ~6-8 kernels). An assumption; calibrate it.
    layer_overhead_s: float = 8e-6
    # Per-step host work not overlapped with the GPU (scheduling, sampling). Assumption; calibrate.
    step_overhead_s: float = 100e-6
    # Seconds added to every TP collective beyond the link model (its launch, the barrier of the
    # ranks, the copy into a registered buffer). 0 at kernel peak; the engine profile fits it.
    comm_latency_s: float = 0.0
    # Seconds per decoder layer charged once more on every step that holds prefill (context)
    # tokens, on top of layer_overhead_s, which every step pays: the fixed work a context pass does
    # per layer and a decode step does not. What it is thought to be (a plausible account, not a
    # measured breakdown): TensorRT-LLM v0.5's context phase (gptSession.cpp runs step 0 as its own
    # pass over the prompts, after reshaping its buffers to their lengths), in which each layer's GPT
    # attention plugin (plugins/gptAttentionCommon/gptAttentionCommon.cpp, enqueueContext) binds
    # cuBLAS to the stream and workspace, rebuilds cu_seqlens, padding offsets and the mask
    # (invokeBuildDecoderInfo) and sets up the fused-MHA runner before any math. Its size comes from
    # the measured rows (published.py): TensorRT-LLM's first-token latency at 128 prompt tokens sits
    # 3.7-17 ms above a forward pass that fits the 2048-token rows, ~115-150 us per layer on H100
    # and ~215 on A100. 0 at kernel peak; the engine profile fits one value (profiles.py).
    prefill_layer_overhead_s: float = 0.0
    # Seconds per sparse (Mixture-of-Experts) layer per step beyond its experts' bytes: the
    # fused-MoE kernels' sort-and-pad of (token, expert) pairs and grouped GEMMs too short, at a
    # few rows per expert, to keep the memory system busy. 0 at kernel peak; the engine profile
    # takes the median residual of published fused-MoE kernel timings (moe_kernels.py).
    moe_layer_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gemm_compute", "attention_compute", "memory", "comm"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")
        if not 0 <= self.gemm_compute_8bit <= 1:
            raise ValueError(f"efficiency gemm_compute_8bit must be in [0, 1] (0: same as gemm_compute), "
                             f"got {self.gemm_compute_8bit}")
        if min(self.layer_overhead_s, self.step_overhead_s, self.comm_latency_s, self.prefill_layer_overhead_s,
               self.moe_layer_overhead_s) < 0:
            raise ValueError("overheads must be >= 0")

    @classmethod
    def ideal(cls) -> Efficiencies:
        """The roofline itself: every resource at its datasheet peak, no gaps."""
        return cls(gemm_compute=1.0, attention_compute=1.0, memory=1.0, comm=1.0, layer_overhead_s=0.0,
                   step_overhead_s=0.0, comm_latency_s=0.0, prefill_layer_overhead_s=0.0)

    def gemm_share(self, compute_dtype: str) -> float:
        """Share of dense peak a matmul on `compute_dtype` tensor cores reaches ("fp8", "int8":
        gemm_compute_8bit when set, else gemm_compute; every other dtype: gemm_compute)."""
        if compute_dtype in ("fp8", "int8") and self.gemm_compute_8bit > 0:
            return self.gemm_compute_8bit
        return self.gemm_compute

    def replace(self, **changes: float) -> Efficiencies:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
