"""VRAM per GPU = weights + KV cache + activation peak + runtime overhead; KV capacity by the
budget rules of vLLM and TensorRT-LLM.

    vram(model, batch=64, context_len=4096, weight_dtype="fp8", tp=2)     -> MemoryBreakdown
    kv_capacity_tokens(model, gpu, rule="vllm", gpu_memory_utilization=0.9) -> int
    max_num_seqs(model, gpu, context_len=4096)                             -> int
    seed_table()                                                           -> the rough-size table

Budget rules (facts.md): vLLM: KV = total x gpu_memory_utilization - weights - activation peak -
non-torch memory (it profiles a forward pass of max_num_batched_tokens); TRT-LLM: KV =
free_gpu_memory_fraction x (memory free after weights and runtime buffers).

Approximate parts, said out loud: the activation peak is an estimate of the largest live tensors
of one forward pass (MLP intermediate, QKV, residual, fp32 logits), not a profile; the runtime
overhead (CUDA context, cuBLAS workspace, NCCL buffers, CUDA graphs) is a flat 1.5 GiB assumption.
Both only matter at the margin: they shift KV capacity by a few GiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.roofline.hardware import GiB, GPUSpec, get_gpu
from stoker.roofline.modelspec import ModelSpec, get_model_spec

RUNTIME_OVERHEAD_BYTES = 1.5 * GiB
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's chunked-prefill token budget on large GPUs
BLOCK_SIZE = 16  # vLLM's default KV block (tokens)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU of a tensor-parallel group."""

    weights_bytes: float
    kv_bytes: float
    activation_bytes: float
    overhead_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes + self.overhead_bytes

    def as_gib(self) -> dict[str, float]:
        return {"weights_gib": self.weights_bytes / GiB, "kv_gib": self.kv_bytes / GiB,
                "activation_gib": self.activation_bytes / GiB, "overhead_gib": self.overhead_bytes / GiB,
                "total_gib": self.total_bytes / GiB}


def _model(model: ModelSpec | str) -> ModelSpec:
    return get_model_spec(model) if isinstance(model, str) else model


def weights_per_gpu(model: ModelSpec | str, weight_dtype: str = "bf16", tp: int = 1) -> float:
    """Weights are sharded evenly across TP ranks (norms replicate; negligible)."""
    return _model(model).weight_bytes(weight_dtype) / tp


def activation_peak_bytes(model: ModelSpec | str, num_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                          tp: int = 1) -> float:
    """Largest live tensors of one forward over `num_tokens`: gate+up output, QKV and two residual
    copies in bf16, plus fp32 logits for up to 256 sampled rows. An estimate, not a profile."""
    m = _model(model)
    per_token = (2 * m.active_intermediate_size() + m.q_dim + 2 * m.kv_dim) / tp + 2 * m.hidden_size
    return num_tokens * per_token * 2.0 + min(num_tokens, 256) * m.vocab_size / tp * 4.0


def vram(model: ModelSpec | str, *, batch: int, context_len: int, weight_dtype: str = "bf16",
         kv_dtype: str = "bf16", tp: int = 1, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
         overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> MemoryBreakdown:
    """Memory one GPU needs to hold `batch` sequences of `context_len` tokens."""
    m = _model(model)
    return MemoryBreakdown(
        weights_bytes=weights_per_gpu(m, weight_dtype, tp),
        kv_bytes=batch * m.kv_bytes_per_seq(context_len, kv_dtype, tp),  # a sliding window caps its layers
        activation_bytes=activation_peak_bytes(m, max_num_batched_tokens, tp),
        overhead_bytes=overhead_bytes,
    )


def kv_budget_bytes(model: ModelSpec | str, gpu: GPUSpec | str, *, weight_dtype: str = "bf16", tp: int = 1,
                    rule: str = "vllm", gpu_memory_utilization: float = 0.9,
                    free_gpu_memory_fraction: float = 0.9,
                    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                    overhead_bytes: float = RUNTIME_OVERHEAD_BYTES) -> float:
    """Bytes per GPU left for KV blocks under vLLM's or TRT-LLM's rule (may be negative)."""
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    weights = weights_per_gpu(model, weight_dtype, tp)
    act = activation_peak_bytes(model, max_num_batched_tokens, tp)
    if rule == "vllm":
        return g.memory_bytes * gpu_memory_utilization - weights - act - overhead_bytes
    if rule == "trtllm":
        return free_gpu_memory_fraction * (g.memory_bytes - weights - act - overhead_bytes)
    raise ValueError(f"unknown budget rule {rule!r}; choose vllm or trtllm")


def kv_capacity_tokens(model: ModelSpec | str, gpu: GPUSpec | str, *, weight_dtype: str = "bf16",
                       kv_dtype: str = "bf16", tp: int = 1, **budget: float | str) -> int:
    """Tokens of KV cache that fit (whole blocks of 16), what vLLM logs as "GPU KV cache size"."""
    m = _model(model)
    free = kv_budget_bytes(m, gpu, weight_dtype=weight_dtype, tp=tp, **budget)  # type: ignore[arg-type]
    if free <= 0:
        return 0
    return math.floor(free / m.kv_bytes_per_token(kv_dtype, tp) / BLOCK_SIZE) * BLOCK_SIZE


def max_num_seqs(model: ModelSpec | str, gpu: GPUSpec | str, *, context_len: int, weight_dtype: str = "bf16",
                 kv_dtype: str = "bf16", tp: int = 1, **budget: float | str) -> int:
    """Sequences of `context_len` tokens whose KV fits at once (vLLM's "maximum concurrency")."""
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    tokens = kv_capacity_tokens(model, gpu, weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp, **budget)
    return tokens // BLOCK_SIZE // blocks_per_seq


# The seed table's rough sizes ("7B/13B/70B/405B at FP16/INT8/INT4"): params x bytes/param.
SEED_MODELS = {"7B": "llama-2-7b", "13B": "llama-2-13b", "70B": "llama-3-70b", "405B": "llama-3.1-405b"}
SEED_BYTES = {"fp16": 2.0, "int8": 1.0, "int4": 0.5}


def seed_table() -> list[dict[str, object]]:
    """Rough weight sizes next to ours. Rough = nominal params x bytes; ours counts the real
    parameter count, keeps embeddings/lm_head in 16 bits and adds int4 group scales, which is why
    INT4 lands ~6-13% above the rough figure (most for big vocabularies: Llama-3)."""
    rows = []
    for label, preset in SEED_MODELS.items():
        m = get_model_spec(preset)
        nominal = float(label[:-1]) * 1e9
        for dtype, nbytes in SEED_BYTES.items():
            ours = m.weight_bytes("bf16" if dtype == "fp16" else dtype)
            rows.append({"model": label, "preset": preset, "dtype": dtype, "rough_gb": nominal * nbytes / 1e9,
                         "model_gb": ours / 1e9, "ratio": ours / (nominal * nbytes)})
    return rows
