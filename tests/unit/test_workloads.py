"""Run-level formulas: static batches, chunked prefill, custom all-reduce, overlap."""

from __future__ import annotations

import math

import pytest

from stoker.roofline.collectives import CUSTOM_AR_LATENCY_US, all_reduce_time, custom_all_reduce_time
from stoker.roofline.costmodel import step_cost
from stoker.roofline.hardware import get_link
from stoker.roofline.planner import PlanTargets, serving_times
from stoker.roofline.profiles import ENGINE
from stoker.roofline.workloads import chunked_prefill_s, static_batch_time_s, static_batch_tokens_per_s

NVLINK = get_link("nvlink4")


def test_static_batch_is_one_prefill_plus_decode_steps() -> None:
    kw = dict(batch=8, weight_dtype="bf16", tp=1)
    total = static_batch_time_s("llama-3-8b", "H100", input_len=100, output_len=11, **kw)
    pf = step_cost("llama-3-8b", "H100", phase="prefill", context_len=100, **kw).step_time_s
    steps = sum(step_cost("llama-3-8b", "H100", context_len=c, **kw).step_time_s for c in range(101, 111))
    assert total == pytest.approx(pf + steps, rel=1e-3)  # trapezoid over a near-linear sum
    assert static_batch_time_s("llama-3-8b", "H100", input_len=100, output_len=1, **kw) == pytest.approx(pf)


def test_chunked_prefill_charges_chunks_not_prompts() -> None:
    one_prompt = step_cost("llama-3-8b", "H100", phase="prefill", context_len=512).step_time_s
    chunk = step_cost("llama-3-8b", "H100", phase="prefill", context_len=512, chunk_tokens=4096).step_time_s
    batched = chunked_prefill_s("llama-3-8b", "H100", prompt_tokens=16 * 512, prompt_len=512, chunk_tokens=4096)
    assert batched == pytest.approx(2 * chunk)
    # Batching eight prompts into one chunk streams the weights once, not eight times.
    assert batched < 16 * one_prompt
    assert chunked_prefill_s("llama-3-8b", "H100", prompt_tokens=0, prompt_len=512, chunk_tokens=4096) == 0
    with pytest.raises(ValueError):
        step_cost("llama-3-8b", "H100", phase="decode", chunk_tokens=8)


def test_custom_all_reduce_formula_and_limits() -> None:
    s = 16 * 1024
    one = custom_all_reduce_time(s, 8, NVLINK)
    assert one is not None and one.algorithm == "one_shot"
    assert one.time_s == pytest.approx(CUSTOM_AR_LATENCY_US * 1e-6 + 7 * s / 450e9)
    big = custom_all_reduce_time(4 * 1024 * 1024, 8, NVLINK)
    assert big is not None and big.algorithm == "two_shot"
    assert big.time_s == pytest.approx(2 * CUSTOM_AR_LATENCY_US * 1e-6 + 2 * 7 / 8 * 4 * 1024 * 1024 / 450e9)
    assert custom_all_reduce_time(16 * 1024 * 1024, 8, NVLINK) is None  # over vLLM's 8 MiB max_size
    assert custom_all_reduce_time(s, 3, NVLINK) is None  # world size 3 unsupported
    assert custom_all_reduce_time(s, 2, get_link("pcie4")) is None
    # The TP ceiling takes the fastest, so it stays below what custom kernels measure (sglang#2904:
    # 5.9 us for 512 B at TP8 on H100), where NCCL alone would put it above.
    assert all_reduce_time(512, 8, NVLINK).time_s <= 5.9e-6 < all_reduce_time(512, 8, NVLINK, custom=False).time_s


def test_overlap_hides_comm_up_to_the_compute() -> None:
    plain = step_cost("llama-3-70b", "H100", batch=64, tp=8)
    hidden = step_cost("llama-3-70b", "H100", batch=64, tp=8, overlap_comm=True)
    comm = next(op.time_s for op in plain.ops if op.name == "all_reduce")
    rest = plain.step_time_s - comm
    assert hidden.step_time_s == pytest.approx(rest + max(0.0, comm - rest))
    assert hidden.latency_floor_s <= plain.latency_floor_s


def test_plan_times_chunked_prefill_under_the_token_budget() -> None:
    t = PlanTargets(1000, prompt_len=1024, output_len=256, max_num_batched_tokens=8192)
    kw = dict(tp=1, weight_dtype="fp8", kv_dtype="fp8", link=NVLINK, eff=ENGINE)
    step, ttft, _ = serving_times(*_m_g(), t, max_batch=64, **kw)
    decode = step_cost(*_m_g(), batch=64, context_len=1024 + 128, weight_dtype="fp8", kv_dtype="fp8", eff=ENGINE)
    # 64 x 1024 / 256 = 256 prompt tokens arrive per step; a waiting prompt is taken whole (it fits
    # in the 8192 - 64 room), so the chunk is one 1024-token prompt, charged a quarter per step.
    chunk_s = step_cost(*_m_g(), phase="prefill", context_len=1024, chunk_tokens=1024, weight_dtype="fp8",
                        kv_dtype="fp8", eff=ENGINE).step_time_s
    assert step == pytest.approx(decode.step_time_s + 256 / 1024 * chunk_s)
    assert ttft == pytest.approx(chunk_s + decode.step_time_s)
    # At batch 512, 2048 prompt tokens arrive per step: two prompts batched per chunk.
    step512, _, _ = serving_times(*_m_g(), t, max_batch=512, **kw)
    decode512 = step_cost(*_m_g(), batch=512, context_len=1024 + 128, weight_dtype="fp8", kv_dtype="fp8", eff=ENGINE)
    chunk2 = step_cost(*_m_g(), phase="prefill", context_len=1024, chunk_tokens=2048, weight_dtype="fp8",
                       kv_dtype="fp8", eff=ENGINE).step_time_s
    assert step512 == pytest.approx(decode512.step_time_s + chunk2)
    # A prompt longer than the room is split: ceil(prompt / room) chunks, one decode step each.
    long = PlanTargets(1000, prompt_len=10000, output_len=256, max_num_batched_tokens=8192)
    _, ttft_long, _ = serving_times(*_m_g(), long, max_batch=64, **kw)
    room = 8192 - 64
    room_s = step_cost(*_m_g(), phase="prefill", context_len=10000, chunk_tokens=room, weight_dtype="fp8",
                       kv_dtype="fp8", eff=ENGINE).step_time_s
    decode_long = step_cost(*_m_g(), batch=64, context_len=10000 + 128, weight_dtype="fp8", kv_dtype="fp8", eff=ENGINE)
    assert ttft_long == pytest.approx(10000 / room * room_s + math.ceil(10000 / room) * decode_long.step_time_s)


def _m_g() -> tuple[str, str]:
    return "llama-3-8b", "H100"


def test_static_batch_throughput_is_output_tokens_over_the_whole_run() -> None:
    # TensorRT-LLM's definition (docs/source/blogs/XQA-kernel.md): out_tps = output_seqlen x
    # batch_size / total_latency / tp; total_latency includes the context phase. Ours is the
    # group's figure, so per GPU it is divided by tp.
    kw = dict(batch=64, input_len=2048, output_len=128, weight_dtype="fp8", kv_dtype="fp8", tp=2, eff=ENGINE)
    total = static_batch_time_s("llama-2-70b", "H100", **kw)
    assert static_batch_tokens_per_s("llama-2-70b", "H100", **kw) == pytest.approx(64 * 128 / total)
    # The prefill is in the time: a 2048-token prompt costs more than a 128-token one at equal output.
    short = static_batch_time_s("llama-2-70b", "H100", **{**kw, "input_len": 128})
    assert total > short


def test_fp8_gemm_share_slows_fp8_static_batches_only() -> None:
    slow = ENGINE.replace(gemm_compute_8bit=ENGINE.gemm_compute_8bit / 2)
    fp8 = dict(batch=256, input_len=2048, output_len=16, weight_dtype="fp8", kv_dtype="fp8")
    bf16 = dict(batch=256, input_len=2048, output_len=16, weight_dtype="bf16")
    assert static_batch_time_s("llama-2-7b", "H100", eff=slow, **fp8) > 1.3 * static_batch_time_s(
        "llama-2-7b", "H100", eff=ENGINE, **fp8)
    assert static_batch_time_s("llama-2-7b", "H100", eff=slow, **bf16) == static_batch_time_s(
        "llama-2-7b", "H100", eff=ENGINE, **bf16)
