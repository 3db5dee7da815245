"""KV-cache capacity of one replica: tokens and blocks, from the memory an engine really sees.

    kv_capacity(model, gpu, tp=2, weight_dtype="fp8", kv_dtype="fp8", gpu_memory_utilization=0.9)
        -> KVCapacity (usable memory, every overhead charged, KV bytes, tokens, blocks, max sequences)

The rule is vLLM's (facts.md): KV = usable_memory x gpu_memory_utilization - weights - activation
peak - non-torch memory, per GPU, the KV of a token split over the TP ranks. What differs from
memory.kv_budget_bytes (datasheet capacity, one flat overhead) is that every term is named with
its source, and the capacity starts from the memory the CUDA runtime reports, not the datasheet:

  usable memory  H100 80 GB: 79.22 GiB, vLLM's "total_gpu_memory" on H100-80G (vllm-project/vllm
                 PR #10511 and PR #12126 logs). Where no public figure is known, the datasheet
                 capacity (hardware.py), said so in `usable_source`.
  activations    memory.activation_peak_bytes over the scheduler's token budget (an estimate: for
                 Llama-3-8B at 8192 tokens it gives 0.78 GiB where vLLM's profile logged 1.26 GiB,
                 PR #10511).
  non-torch      CUDA context, cuBLAS workspaces, allocator slack: 1.79 GiB at TP1 (vLLM's
                 "non_torch_memory", Llama-3-8B on H100, PR #10511).
  NCCL buffers   TP > 1 adds NCCL's and the custom all-reduce's buffers: 1.79 GiB more (the same
                 log at -tp 2: non_torch_memory 3.58 GiB).
  CUDA graphs    not charged to KV: vLLM captures them after sizing the cache, inside the
                 1 - gpu_memory_utilization headroom (2464 MiB measured on 4 x RTX 4090 for Yi-34B,
                 vllm-project/vllm issue #7553); listed with that headroom.
Checked (tests/unit/test_kvcapacity.py): Llama-3-8B bf16 on one H100 at 0.90 gives 53.8 GiB of
KV where vLLM logged 53.29 GiB (PR #10511).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.roofline.hardware import GiB, GPUSpec, get_gpu
from stoker.roofline.memory import BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, activation_peak_bytes, weights_per_gpu
from stoker.roofline.modelspec import ModelSpec, get_model_spec

# Memory the CUDA runtime reports as total, per device (GiB), with its source.
USABLE_MEMORY_GIB: dict[str, tuple[float, str]] = {
    "H100-SXM": (79.22, "vLLM log total_gpu_memory (79.22GiB) on H100-80G, vllm-project/vllm PR #10511, #12126"),
}
NON_TORCH_BYTES = 1.79 * GiB  # vllm-project/vllm PR #10511: non_torch_memory 1.79 GiB (TP1, H100)
NCCL_BUFFER_BYTES = 1.79 * GiB  # same log at -tp 2: 3.58 GiB, i.e. 1.79 GiB more
CUDA_GRAPH_NOTE = "CUDA graphs: captured after KV sizing, inside the 1 - utilization headroom (vllm#7553: 2.4 GiB on 4 x 4090)"


@dataclass(frozen=True)
class Overhead:
    name: str
    bytes: float
    source: str


@dataclass(frozen=True)
class KVCapacity:
    model: str
    gpu: str
    tp: int
    weight_dtype: str
    kv_dtype: str
    gpu_memory_utilization: float
    usable_bytes: float  # per GPU, what the runtime reports
    usable_source: str
    weights_bytes: float  # per GPU
    overheads: tuple[Overhead, ...]
    kv_bytes: float  # per GPU, for KV blocks (0 when nothing is left)
    kv_bytes_per_token: float  # per GPU (the token's KV split over TP ranks)
    block_size: int
    sliding_window: int = 0  # tokens a sliding-window layer holds at most (gpt-oss: 128)
    sliding_share: float = 0.0  # share of the layers with a window (gpt-oss: 1/2)

    @property
    def num_blocks(self) -> int:
        return math.floor(self.kv_bytes / (self.kv_bytes_per_token * self.block_size))

    @property
    def tokens(self) -> int:
        """Tokens of KV one replica holds (whole blocks), what vLLM logs as "GPU KV cache size"."""
        return self.num_blocks * self.block_size

    @property
    def headroom_bytes(self) -> float:
        """Memory outside the engine's budget: (1 - utilization) x usable, where CUDA graphs live."""
        return self.usable_bytes * (1 - self.gpu_memory_utilization)

    def max_seqs(self, seq_len: int) -> int:
        """Sequences of `seq_len` tokens whose blocks all fit at once (vLLM's "maximum concurrency")."""
        if seq_len < 1:
            raise ValueError("seq_len must be >= 1")
        if not self.sliding_share:
            return self.num_blocks // math.ceil(seq_len / self.block_size)
        # Sliding-window layers keep at most their window's blocks (vLLM's hybrid KV manager frees the
        # rest): a sequence takes, averaged over layers, full-layer blocks for all its tokens and
        # window-layer blocks for min(seq_len, window) of them.
        full = math.ceil(seq_len / self.block_size)
        window = math.ceil(min(seq_len, self.sliding_window) / self.block_size)
        return math.floor(self.num_blocks / ((1 - self.sliding_share) * full + self.sliding_share * window))

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model, "gpu": self.gpu, "tp": self.tp, "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype, "gpu_memory_utilization": self.gpu_memory_utilization,
            "usable_gib": self.usable_bytes / GiB, "usable_source": self.usable_source,
            "budget_gib": self.usable_bytes * self.gpu_memory_utilization / GiB,
            "weights_gib": self.weights_bytes / GiB,
            "overheads": [{"name": o.name, "gib": o.bytes / GiB, "source": o.source} for o in self.overheads],
            "kv_gib": self.kv_bytes / GiB, "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size, "num_blocks": self.num_blocks, "tokens": self.tokens,
            "headroom_gib": self.headroom_bytes / GiB,
        }


def usable_memory(gpu: GPUSpec) -> tuple[float, str]:
    """(bytes, source) the runtime reports for `gpu`; the datasheet capacity where none is known.
    A MIG slice takes its memory slices' share of its parent's figure."""
    if gpu.parent and gpu.parent in USABLE_MEMORY_GIB:
        parent = get_gpu(gpu.parent)
        gib, src = USABLE_MEMORY_GIB[gpu.parent]
        return gib * gpu.memory_gb / parent.memory_gb * GiB, f"{src}; MIG share {gpu.memory_gb:g}/{parent.memory_gb:g}"
    if gpu.name in USABLE_MEMORY_GIB:
        gib, src = USABLE_MEMORY_GIB[gpu.name]
        return gib * GiB, src
    return gpu.memory_bytes, f"datasheet {gpu.memory_gb:g} GiB (no public runtime figure known: an upper bound)"


def overheads(model: ModelSpec, tp: int, max_num_batched_tokens: int) -> tuple[Overhead, ...]:
    out = [
        Overhead("activation peak", activation_peak_bytes(model, max_num_batched_tokens, tp),
                 f"estimate over {max_num_batched_tokens} scheduled tokens (memory.activation_peak_bytes)"),
        Overhead("non-torch runtime", NON_TORCH_BYTES, "CUDA context, cuBLAS workspaces (vllm PR #10511, TP1)"),
    ]
    if tp > 1:
        out.append(Overhead("NCCL + custom all-reduce buffers", NCCL_BUFFER_BYTES, "vllm PR #10511: +1.79 GiB at -tp 2"))
    return tuple(out)


def kv_capacity(model: ModelSpec | str, gpu: GPUSpec | str, *, tp: int = 1, weight_dtype: str = "bf16",
                kv_dtype: str = "bf16", gpu_memory_utilization: float = 0.9,
                max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                block_size: int = BLOCK_SIZE) -> KVCapacity:
    """KV capacity of one TP group under vLLM's budget rule, with every term listed."""
    m = get_model_spec(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError("gpu memory utilization must be in (0, 1]")
    if tp < 1 or block_size < 1 or max_num_batched_tokens < 1:
        raise ValueError("tp, block size and max_num_batched_tokens must be >= 1")
    usable, src = usable_memory(g)
    weights = weights_per_gpu(m, weight_dtype, tp)
    extra = overheads(m, tp, max_num_batched_tokens)
    kv = usable * gpu_memory_utilization - weights - sum(o.bytes for o in extra)
    return KVCapacity(m.name, g.name, tp, weight_dtype, kv_dtype, gpu_memory_utilization, usable, src, weights,
                      extra, max(0.0, kv), m.kv_bytes_per_token(kv_dtype, tp), block_size,
                      m.sliding_window, m.num_sliding_layers / m.num_layers)


def format_report(cap: KVCapacity) -> list[str]:
    """The `stoker roofline kv` text: budget, each charge, what is left, tokens and blocks."""
    budget = cap.usable_bytes * cap.gpu_memory_utilization
    rows: list[tuple[str, float, str]] = [
        ("usable memory", cap.usable_bytes, cap.usable_source),
        ("engine budget", budget, f"usable x {cap.gpu_memory_utilization:g}"),
        ("- weights", cap.weights_bytes, f"{cap.weight_dtype}, 1/{cap.tp} per GPU"),
        *((f"- {o.name}", o.bytes, o.source) for o in cap.overheads),
        ("= KV cache", cap.kv_bytes, f"{cap.kv_bytes_per_token:,.0f} B per token per GPU"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{cap.model} on {cap.gpu}{f' x {cap.tp} (TP{cap.tp})' if cap.tp > 1 else ''}, {cap.weight_dtype} weights / "
             f"{cap.kv_dtype} KV, gpu_memory_utilization {cap.gpu_memory_utilization:g} (per GPU):"]
    lines += [f"  {label:<{width}} {value / GiB:8.2f} GiB  ({why})" for label, value, why in rows]
    lines += [
        f"KV capacity per replica: {cap.tokens:,} tokens = {cap.num_blocks:,} blocks of {cap.block_size}",
        f"not charged: {CUDA_GRAPH_NOTE}; headroom {cap.headroom_bytes / GiB:.2f} GiB",
    ]
    if cap.kv_bytes <= 0:
        lines.append("nothing left for KV: weights and overheads exceed the budget (raise TP, quantize, or raise utilization)")
    return lines
