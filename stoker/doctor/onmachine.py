"""The on-machine check of the cost model: predict the CPU engine's steps from microbenchmarks,
then time the steps, and compare (benchmarks/predict_cpu.py prints it; a slow test asserts it).

Held out: nothing measured from the steps (`step_timing.step_seconds` of the real model) reaches `fit`. The microbenchmarks run the
engine's kernels at the model's shapes (microbench.py), the same calls at near-empty shapes
for their fixed parts, and a near-empty model with the same layers for the host overhead; the steps run the real engine (`LLM` on a random checkpoint).
Rounds interleave the two, and each figure is the median over rounds, so load from other jobs
on a shared machine falls on both sides alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.doctor import microbench, step_timing
from stoker.roofline.costmodel import step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec
from stoker.roofline.microfit import (
    FP32,
    Microbenchmarks,
    MicroFit,
    StepPrediction,
    fit,
    predict_step,
)
from stoker.roofline.modelspec import ModelSpec, get_model_spec

# Issue 2's model shape (benchmarks/tp_cpu.py): 95 MB of float32 weights, past the private
# caches, so a decode step at small batch is weight streaming.
ISSUE2_SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                                "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4096}
# The overhead probe: the same 8 layers and ops, 1.3 MB of weights (hidden 64: one 64-wide
# panel; head_dim 16: the prefill kernel's vector width), so its step is host work.
OVERHEAD_SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 8,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
OVERHEAD_CONTEXT = 16
# Attention microbenchmark shapes: none is a point of the default sweep.
DECODE_ATTENTION_SHAPE = (8, 768)
PREFILL_ATTENTION_LENS = (384, 1536)


@dataclass(frozen=True)
class Point:
    phase: str  # "decode" | "prefill"
    batch: int
    context_len: int

    @property
    def tokens(self) -> int:
        return self.batch if self.phase == "decode" else self.batch * self.context_len


def sweep_points(batches: Sequence[int], contexts: Sequence[int], prefill_lens: Sequence[int]) -> list[Point]:
    return [Point("decode", b, c) for b in batches for c in contexts] + [Point("prefill", 1, n) for n in prefill_lens]


def build_checkpoints(root: Path) -> tuple[Path, Path]:
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    return (make_tiny_checkpoint(root / "issue2", "llama", **ISSUE2_SHAPE),
            make_tiny_checkpoint(root / "overhead", "llama", **OVERHEAD_SHAPE))


def build_llm(path: Path, points: Sequence[Point]) -> Any:
    """An engine whose KV cache holds the largest point (distinct blocks per sequence)."""
    from stoker import LLM

    max_ctx = max(p.context_len for p in points)
    blocks = max(step_timing.blocks_needed(p.batch, p.context_len) for p in points) + 4
    spec = get_model_spec(str(path))
    kv_bytes = blocks * 16 * spec.kv_bytes_per_token("fp32")
    return LLM(str(path), max_model_len=max_ctx + 16, max_num_seqs=max(p.batch for p in points),
               kv_cache_memory_bytes=int(kv_bytes), enable_prefix_caching=False)


@dataclass
class Samples:
    """Per-round medians, reduced to their median over rounds."""

    values: dict[Any, list[float]]

    def median(self, key: Any) -> float:
        return statistics.median(self.values[key])

    def add(self, key: Any, seconds: float) -> None:
        self.values.setdefault(key, []).append(seconds)


def microbench_round(spec: ModelSpec, chain: microbench.ProjectionChain, overhead_llm: Any, tokens: set[int],
                     batches: set[int], samples: Samples, iters: int, tiny_chain: microbench.ProjectionChain | None = None,
                     prompt_lens: set[int] = frozenset()) -> None:
    for m in sorted(tokens):
        samples.add(("chain", m), chain.seconds(m, iters if m < 512 else max(2, iters // 4)))
    if tiny_chain is not None:
        # The chain's fixed part: the same 4 x L calls on the probe's 64-wide weights, one row
        # (at 2 threads each call's fork/join; the probe charges it).
        samples.add(("chain_fixed",), tiny_chain.seconds(1, 3 * iters))
    for m in sorted(tokens | {1}):
        samples.add(("row_ops", m), microbench.row_ops_s(spec, m, iters))
    b, c = DECODE_ATTENTION_SHAPE
    samples.add(("decode_attention",), microbench.decode_attention_s(spec, b, c, iters, flush=True))
    samples.add(("decode_attention_fixed",), microbench.decode_attention_s(spec, 1, 1, 3 * iters))
    bs = overhead_llm.engine.executor.driver_runner.block_size
    for n in sorted(prompt_lens | {1} if prompt_lens else set()):
        samples.add(("host_inputs", n), step_timing.host_inputs_s(n, bs, iters))
    for n in PREFILL_ATTENTION_LENS:
        samples.add(("prefill_attention", n), microbench.prefill_attention_s(spec, n, max(2, iters // 4)))
    for b in sorted(batches):
        samples.add(("overhead", b), step_timing.cold_host_step_seconds(overhead_llm, b, OVERHEAD_CONTEXT, iters))


def to_microbenchmarks(samples: Samples, device: GPUSpec, overhead_spec: ModelSpec) -> Microbenchmarks:
    keys = samples.values
    chain = {k[1]: samples.median(k) for k in keys if k[0] == "chain"}
    overhead = {k[1]: samples.median(k) for k in keys if k[0] == "overhead"}
    floor = {b: step_cost(overhead_spec, device, phase="decode", batch=b, context_len=OVERHEAD_CONTEXT,
                          eff=Efficiencies.ideal(), **FP32).latency_floor_s for b in overhead}  # type: ignore[arg-type]
    return Microbenchmarks(chain, (*DECODE_ATTENTION_SHAPE, samples.median(("decode_attention",))),
                           {n: samples.median(("prefill_attention", n)) for n in PREFILL_ATTENTION_LENS}, overhead, floor,
                           {k[1]: samples.median(k) for k in keys if k[0] == "row_ops"},
                           samples.median(("chain_fixed",)) if ("chain_fixed",) in keys else 0.0,
                           samples.median(("decode_attention_fixed",)) if ("decode_attention_fixed",) in keys else 0.0,
                           {k[1]: samples.median(k) for k in keys if k[0] == "host_inputs"})


@dataclass(frozen=True)
class Row:
    point: Point
    predicted: StepPrediction
    measured_s: float

    @property
    def ratio(self) -> float:
        """measured / predicted: > 1 when the engine is slower than the model says."""
        return self.measured_s / self.predicted.step_time_s


def run_check(points: Sequence[Point], device: GPUSpec, root: Path, rounds: int = 3, iters: int = 7,
              step_iters: int = 9) -> tuple[MicroFit, Microbenchmarks, list[Row]]:
    """Microbenchmarks and steps in `rounds` interleaved rounds; fit; predict; compare."""
    path, overhead_path = build_checkpoints(root)
    spec, overhead_spec = get_model_spec(str(path)), get_model_spec(str(overhead_path))
    llm = build_llm(path, points)
    overhead_llm = build_llm(overhead_path, [Point("decode", p.batch, OVERHEAD_CONTEXT) for p in points])
    chain, tiny_chain = microbench.ProjectionChain(spec), microbench.ProjectionChain(overhead_spec)
    tokens = {p.tokens for p in points} | {p.batch for p in points}  # the LM head runs on `batch` rows
    batches = {p.batch for p in points if p.phase == "decode"} | {1}
    prompt_lens = {p.tokens for p in points if p.phase == "prefill"}
    micro, steps = Samples({}), Samples({})
    for _ in range(rounds):
        microbench_round(spec, chain, overhead_llm, tokens, batches, micro, iters, tiny_chain, prompt_lens)
        for p in points:
            n = step_iters if p.tokens < 512 else max(2, step_iters // 3)
            steps.add(p, step_timing.step_seconds(llm, p.phase, p.batch, p.context_len, n, warmup=1))
    mb = to_microbenchmarks(micro, device, overhead_spec)
    f = fit(spec, device, mb)
    rows = [Row(p, predict_step(spec, f, phase=p.phase, batch=p.batch, context_len=p.context_len),
                steps.median(p)) for p in points]
    return f, mb, rows
