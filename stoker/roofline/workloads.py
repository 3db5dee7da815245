"""Whole runs built from step costs: what published benchmarks measure, not one step.

    static_batch_tokens_per_s(model, gpu, batch=64, input_len=128, output_len=128)  -> output tokens/s
    chunked_prefill_s(model, gpu, prompt_tokens=..., prompt_len=..., chunk_tokens=...) -> seconds

A static batch (TensorRT-LLM's gptSessionBenchmark, the tables of docs/source/performance.md up to
v0.6.1): every sequence is prefilled together (one context step over batch x input_len tokens),
then output_len - 1 decode steps run at contexts input_len + 1 ... input_len + output_len - 1
(the first output token comes from the context step: TensorRT-LLM's gptSession.cpp runs step 0 as
the context phase, then generation steps up to maxNewTokens). Output tokens/s = batch x output_len
/ total, the prefill included: TensorRT-LLM defines out_tps = output_seqlen x batch_size /
total_latency / tp (docs/source/blogs/XQA-kernel.md), per GPU; this function returns the group's
figure (x tp of that), and published.py multiplies the tables' per-GPU numbers by TP to compare.
A decode step's time is linear in context inside each op (max of two lines), so the sum over
steps is taken at a few contexts (trapezoid), not at every one.

Chunked prefill (vLLM, SGLang, TensorRT-LLM's scheduler): prompt tokens are batched into chunks of
up to the scheduler's token budget, each chunk one forward; `chunked_prefill_s` charges the
chunks, each attending on average to half a prompt.
"""

from __future__ import annotations


from stoker.roofline.costmodel import step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec, Interconnect
from stoker.roofline.modelspec import ModelSpec

_SAMPLES = 5  # decode contexts sampled across a static run (trapezoid rule)


def _decode_sum_s(model: ModelSpec | str, gpu: GPUSpec | str, *, batch: int, first_ctx: int, steps: int,
                  kw: dict[str, object]) -> float:
    """Sum of `steps` decode step times at contexts first_ctx, first_ctx + 1, ..."""
    if steps <= 0:
        return 0.0
    last_ctx = first_ctx + steps - 1
    n = min(_SAMPLES, steps)
    ctxs = sorted({round(first_ctx + (last_ctx - first_ctx) * i / max(1, n - 1)) for i in range(n)})
    times = [step_cost(model, gpu, batch=batch, context_len=c, **kw).step_time_s for c in ctxs]  # type: ignore[arg-type]
    if len(ctxs) == 1:
        return times[0] * steps
    # Trapezoid over the sampled contexts, scaled to the number of steps.
    area = sum((times[i] + times[i + 1]) / 2 * (ctxs[i + 1] - ctxs[i]) for i in range(len(ctxs) - 1))
    return area / (last_ctx - first_ctx) * steps


def static_batch_time_s(model: ModelSpec | str, gpu: GPUSpec | str, *, batch: int, input_len: int, output_len: int,
                        weight_dtype: str = "bf16", kv_dtype: str | None = None, tp: int = 1,
                        link: Interconnect | str | None = None, eff: Efficiencies | None = None,
                        overlap_comm: bool = False, kv_per_query_head: bool = False) -> float:
    """Seconds for one static batch: one context step, then output_len - 1 decode steps.
    `kv_per_query_head`: the engine's decode attention reads each KV head once per query head
    (costmodel.kv_read_factor; TensorRT-LLM v0.6.1's masked MHA kernel)."""
    if batch < 1 or input_len < 1 or output_len < 1:
        raise ValueError("batch, input_len and output_len must be >= 1")
    kw: dict[str, object] = dict(weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp, link=link, eff=eff,
                                 overlap_comm=overlap_comm, kv_per_query_head=kv_per_query_head, with_floor=False)
    prefill = step_cost(model, gpu, phase="prefill", batch=batch, context_len=input_len, **kw).step_time_s  # type: ignore[arg-type]
    return prefill + _decode_sum_s(model, gpu, batch=batch, first_ctx=input_len + 1, steps=output_len - 1, kw=kw)


def static_batch_tokens_per_s(model: ModelSpec | str, gpu: GPUSpec | str, *, batch: int, input_len: int,
                              output_len: int, **kw: object) -> float:
    """Output tokens/s of a static batch run (all `tp` GPUs together)."""
    return batch * output_len / static_batch_time_s(model, gpu, batch=batch, input_len=input_len,
                                                    output_len=output_len, **kw)  # type: ignore[arg-type]


def chunked_prefill_s(model: ModelSpec | str, gpu: GPUSpec | str, *, prompt_tokens: float, prompt_len: int,
                      chunk_tokens: int, weight_dtype: str = "bf16", kv_dtype: str | None = None, tp: int = 1,
                      link: Interconnect | str | None = None, eff: Efficiencies | None = None,
                      overlap_comm: bool = False) -> float:
    """Seconds to prefill `prompt_tokens` prompt tokens (of prompts `prompt_len` long) in chunks of
    `chunk_tokens` (the caller picks the chunk the scheduler forms): prompt_tokens / chunk_tokens
    chunks, each one forward pass; a fractional count charges a share of a chunk (a rate)."""
    if prompt_tokens <= 0:
        return 0.0
    if chunk_tokens < 1 or prompt_len < 1:
        raise ValueError("chunk_tokens and prompt_len must be >= 1")
    chunk = chunk_tokens
    one = step_cost(model, gpu, phase="prefill", context_len=prompt_len, chunk_tokens=chunk, weight_dtype=weight_dtype,
                    kv_dtype=kv_dtype, tp=tp, link=link, eff=eff, overlap_comm=overlap_comm).step_time_s
    return prompt_tokens / chunk * one
