"""Published fused-MoE kernel timings, and the per-layer floor they put under the cost model. [no torch]

A routed-expert layer costs more than the bytes of the experts its tokens touch: the fused-MoE
kernels sort and pad the (token, expert) pairs into blocks, then run two grouped GEMMs whose
tiles, at a few rows per expert, are too few and too short to keep the memory system busy.
vLLM's and SGLang's `benchmark_moe.py` time exactly that layer (routing given: alignment, both
expert GEMMs, the activation and the weighted sum), and contributors publish its output with
every tuned config. Each point below is one such figure at batch 1, cited; its residual over
the expert bytes at the engine profile's memory share is what the layer loses beyond bandwidth.
The median residual is the engine profile's `moe_layer_overhead_s` (profiles.py), charged once
per sparse layer per step (costmodel.step_ops, "moe_gaps"): a kernel-level figure, so the
end-to-end MoE points (published.MOE_POINTS) still test it out of sample.

Sources (batch-1 rows of the "Kernel time" logs; default or tuned as each label says):
  VLLM_19049   github.com/vllm-project/vllm pull 19049 (the same log as sgl-project/sglang pull
               6825), "Before this PR": Qwen3-30B-A3B (E=128, N=768), bf16, TP1, one
               A100-PCIE-40GB (1555 GB/s, as the 40GB SXM part: hardware.py's A100-40GB row).
  VLLM_24700   github.com/vllm-project/vllm pull 24700, "Benchmarks on H100" (H100 80GB HBM3):
               Mixtral-8x7B bf16 TP2 (E=8, N=7168), tuned config; Qwen3-30B-A3B fp8_w8a8 TP1, "Main".
  SGLANG_11730 github.com/sgl-project/sglang pull 11730, "Without tuned kernel": Qwen3-235B-A22B
               fp8_w8a8 TP8 on H200.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from stoker.roofline.hardware import get_gpu
from stoker.roofline.modelspec import dtype_bytes, get_model_spec

VLLM_19049 = "github.com/vllm-project/vllm/pull/19049"
VLLM_24700 = "github.com/vllm-project/vllm/pull/24700"
SGLANG_11730 = "github.com/sgl-project/sglang/pull/11730"


@dataclass(frozen=True)
class MoEKernelPoint:
    label: str
    model: str  # preset (modelspec)
    gpu: str
    tp: int  # the experts' I is cut over tp ranks (benchmark_moe.py's --tp-size)
    expert_dtype: str
    tokens: int
    measured_us: float
    source: str

    def __post_init__(self) -> None:
        if self.measured_us <= 0 or self.tokens < 1 or self.tp < 1:
            raise ValueError(f"{self.label}: measured_us > 0, tokens >= 1 and tp >= 1 are required")


MOE_KERNEL_POINTS: tuple[MoEKernelPoint, ...] = (
    MoEKernelPoint("Qwen3-30B-A3B bf16 TP1 A100-PCIe-40GB (default config)", "qwen3-30b-a3b", "A100-40GB", 1,
                   "bf16", 1, 109.21, VLLM_19049),
    MoEKernelPoint("Qwen3-30B-A3B fp8 TP1 H100 (main)", "qwen3-30b-a3b", "H100-SXM", 1, "fp8", 1, 44.54, VLLM_24700),
    MoEKernelPoint("Mixtral-8x7B bf16 TP2 H100 (tuned)", "mixtral-8x7b", "H100-SXM", 2, "bf16", 1, 144.03, VLLM_24700),
    MoEKernelPoint("Qwen3-235B-A22B fp8 TP8 H200 (default config)", "qwen3-235b-a22b", "H200", 8, "fp8", 1, 31.70,
                   SGLANG_11730),
)


def expert_bytes(p: MoEKernelPoint) -> float:
    """Bytes of one rank's share of the experts the point's tokens touch (E x (1 - (1 - k/E)^T)
    experts, each cut over tp ranks along I)."""
    m = get_model_spec(p.model)
    return m.experts_touched(p.tokens) * m.expert_params / p.tp * dtype_bytes(p.expert_dtype)


def byte_time_s(p: MoEKernelPoint, memory: float) -> float:
    """Those bytes at `memory` x the GPU's datasheet bandwidth. At batch 1 the layer's FLOPs are
    under a microsecond on every GPU here, so bytes are the whole roofline of the kernel."""
    return expert_bytes(p) / (get_gpu(p.gpu).hbm_gb_per_s * 1e9 * memory)


def residual_s(p: MoEKernelPoint, memory: float) -> float:
    return p.measured_us * 1e-6 - byte_time_s(p, memory)


def moe_layer_floor(memory: float, points: tuple[MoEKernelPoint, ...] = MOE_KERNEL_POINTS) -> float:
    """The median residual, rounded to a microsecond: the engine profile's moe_layer_overhead_s."""
    return round(statistics.median(residual_s(p, memory) for p in points), 6)


def predict_us(p: MoEKernelPoint, memory: float, moe_layer_overhead_s: float) -> float:
    return (byte_time_s(p, memory) + moe_layer_overhead_s) * 1e6
