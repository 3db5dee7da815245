"""Efficiency profiles: the engine profile is the fit it claims to be, it predicts public engine
measurements better than kernel peaks (held-out points included), and profile files round-trip."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from stoker.roofline import moe_kernels, published
from stoker.roofline.calibrate import fit_points, points_loss
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.profiles import ENGINE, KERNEL, get_profile, load_profile, save_profile


def test_new_roofline_modules_import_no_torch() -> None:
    code = ("import sys, stoker.roofline.profiles, stoker.roofline.published, stoker.roofline.kvcapacity, "
            "stoker.roofline.workloads, stoker.roofline.calibrate; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_profile_is_the_fit_of_the_published_points() -> None:
    # Re-run the fit: the constants in profiles.py must be its output, not hand-tuned values.
    # the dense knobs are the fit; the MoE floor is the kernel points' median residual at the fitted memory share
    fitted = fit_points(published.fit_points())
    assert fitted.replace(moe_layer_overhead_s=moe_kernels.moe_layer_floor(fitted.memory)) == ENGINE


def test_engine_profile_beats_kernel_peak_on_public_measurements() -> None:
    pts = published.POINTS
    engine, kernel = published.summary(pts, ENGINE), published.summary(pts, KERNEL)
    assert len(pts) >= 30
    assert kernel["median_ratio"] > 1.1  # kernel peaks are optimistic for engines (issue 16)
    assert abs(engine["median_ratio"] - 1) < 0.05
    assert engine["within"] >= 32 > kernel["within"]
    # Held out of the fit, the engine profile still lands closer than kernel peaks: all ten within 25%.
    held = published.held_out_points()
    assert points_loss(held, ENGINE) < points_loss(held, KERNEL)
    assert published.summary(held, ENGINE)["within"] == 10 > published.summary(held, KERNEL)["within"]


def test_first_token_latency_rows_with_the_context_setup() -> None:
    # Issue 16: without a per-layer context setup the 128-token TTFT rows are 1.5x+ optimistic
    # while the 2048-token rows fit. With it (one fitted value for all GPUs, near what the A100 rows
    # imply), every TTFT row lands within 25% but the 7B H100 one at 128 tokens, which implies
    # ~115 us per layer where the fit settles at ~200: it is left pessimistic, with its note.
    ttft = [p for p in published.POINTS if p.kind == "ttft"]
    assert len(ttft) == 8
    for p in ttft:
        r = published.speed_ratio(p, ENGINE)
        if p.label == "TRT-LLM LLaMA-7B H100 fp8 TTFT 128":
            assert 0.6 < r < 0.75 and p.note, r
        else:
            assert 0.75 <= r <= 1.25, p.label
        assert published.speed_ratio(p, ENGINE.replace(prefill_layer_overhead_s=0.0)) > 1.5 or p.input_len > 128


def test_prefill_layer_overhead_is_charged_once_per_step_holding_prefill() -> None:
    from stoker.core.step import StepShape
    from stoker.roofline.costmodel import mixed_step_cost, step_cost
    from stoker.roofline.hardware import get_gpu
    from stoker.roofline.live import WallModel
    from stoker.roofline.modelspec import get_model_spec
    from stoker.roofline.workloads import chunked_prefill_s, static_batch_time_s

    x, L = 100e-6, 32  # llama-2-7b has 32 layers: each step holding prefill tokens pays 32 x 100 us
    on = KERNEL.replace(prefill_layer_overhead_s=x)
    kw = dict(context_len=128, weight_dtype="bf16")

    def step(eff: Efficiencies, **more) -> float:
        return step_cost("llama-2-7b", "H100", eff=eff, **{**kw, **more}).step_time_s

    # A prefill step (whole prompts, or one chunk): + L x once; a decode step: nothing.
    assert step(on, phase="prefill", batch=4) - step(KERNEL, phase="prefill", batch=4) == pytest.approx(L * x)
    assert step(on, phase="prefill", chunk_tokens=512) - step(KERNEL, phase="prefill", chunk_tokens=512) == pytest.approx(L * x)
    assert step(on, batch=8) == step(KERNEL, batch=8)
    s = step_cost("llama-2-7b", "H100", phase="prefill", eff=on, **kw)
    gaps = [op for op in s.ops if op.name == "prefill_gaps"]
    assert len(gaps) == 1 and gaps[0].time_s == pytest.approx(L * x) and gaps[0].bound == "overhead"
    assert s.latency_floor_s == step_cost("llama-2-7b", "H100", phase="prefill", eff=KERNEL, **kw).latency_floor_s
    # Chunked prefill: once per chunk (4096 prompt tokens in 1024-token chunks: 4 x).
    chunked = dict(prompt_tokens=4096, prompt_len=2048, chunk_tokens=1024)
    assert (chunked_prefill_s("llama-2-7b", "H100", eff=on, **chunked)
            - chunked_prefill_s("llama-2-7b", "H100", eff=KERNEL, **chunked)) == pytest.approx(4 * L * x)
    # A static batch has one context step.
    static = dict(batch=8, input_len=128, output_len=16)
    assert (static_batch_time_s("llama-2-7b", "H100", eff=on, **static)
            - static_batch_time_s("llama-2-7b", "H100", eff=KERNEL, **static)) == pytest.approx(L * x)
    # A mixed step (prefill chunk beside decodes) pays it once; a decode-only step does not.
    mixed = dict(prefill_attended=64 * 65 // 2, decode_seqs=4, decode_context=4 * 300, logits_rows=5)
    assert (mixed_step_cost("llama-2-7b", "H100", prefill_tokens=64, eff=on, **mixed).step_time_s
            - mixed_step_cost("llama-2-7b", "H100", prefill_tokens=64, eff=KERNEL, **mixed).step_time_s) == pytest.approx(L * x)
    decode_only = dict(mixed, prefill_attended=0)
    assert (mixed_step_cost("llama-2-7b", "H100", prefill_tokens=0, eff=on, **decode_only).step_time_s
            == mixed_step_cost("llama-2-7b", "H100", prefill_tokens=0, eff=KERNEL, **decode_only).step_time_s)
    # The live wall prices served steps with the same term.
    m, g = get_model_spec("llama-2-7b"), get_gpu("H100")
    shape = StepShape(num_prefill_tokens=64, prefill_attended=64 * 65 // 2, num_decode_seqs=4, decode_context=1200,
                      num_sampled=5)
    assert (WallModel(m, g, on).judge(shape, 0.01).predicted_s
            - WallModel(m, g, KERNEL).judge(shape, 0.01).predicted_s) == pytest.approx(L * x)
    # Kernel peaks and the ceiling have none; the engine profile fits one; it cannot be negative.
    assert KERNEL.prefill_layer_overhead_s == 0 == Efficiencies.ideal().prefill_layer_overhead_s
    assert ENGINE.prefill_layer_overhead_s > 0
    with pytest.raises(ValueError):
        Efficiencies(prefill_layer_overhead_s=-1e-6)


def test_every_engine_miss_says_why() -> None:
    # A point the engine profile misses by more than 25% carries a note (the docs table prints it):
    # misses are explained or at least named, never silently absorbed.
    for p in published.POINTS:
        if abs(published.speed_ratio(p, ENGINE) - 1) > 0.25:
            assert p.note, p.label


def test_trt_llm_throughput_is_per_gpu_in_both_tables() -> None:
    # performance.md reports out tok/s/GPU for H100 and (header from commit 77d24b5) A100 alike:
    # the group's figure is the table's x TP. A100 LLaMA 70B TP4 b240 128/2048: 525/GPU.
    row = next(p for p in published.POINTS if p.label == "TRT-LLM LLaMA-70B A100 fp16 TP4 b240 128/2048")
    assert row.tp == 4 and row.measured == 4 * 525
    h100 = next(p for p in published.POINTS if p.label == "TRT-LLM LLaMA-70B H100 fp8 TP2 b1024 128/128")
    assert h100.measured == 2 * 2657


def test_engine_profile_has_a_lower_8bit_gemm_share() -> None:
    assert 0 < ENGINE.gemm_compute_8bit < ENGINE.gemm_compute
    assert ENGINE.gemm_share("fp8") == ENGINE.gemm_share("int8") == ENGINE.gemm_compute_8bit
    assert ENGINE.gemm_share("bf16") == ENGINE.gemm_share("fp32") == ENGINE.gemm_compute
    # Kernel peaks keep one share for every dtype (0 = "same as gemm_compute"): unchanged numbers.
    assert KERNEL.gemm_compute_8bit == 0 and KERNEL.gemm_share("fp8") == KERNEL.gemm_compute
    assert Efficiencies.ideal().gemm_share("fp8") == 1.0


def test_gemm_compute_8bit_prices_only_fp8_matmuls() -> None:
    from stoker.roofline.costmodel import step_cost

    def prefill(gpu: str, wd: str, eff: Efficiencies) -> float:
        return step_cost("llama-2-7b", gpu, phase="prefill", context_len=2048, weight_dtype=wd, eff=eff).step_time_s

    slow_8bit = KERNEL.replace(gemm_compute_8bit=KERNEL.gemm_compute / 2)
    # H100 FP8 weights run on FP8 tensor cores: compute-bound prefill GEMMs take ~2x as long.
    assert prefill("H100", "fp8", slow_8bit) > 1.5 * prefill("H100", "fp8", KERNEL)
    assert prefill("H100", "int8", slow_8bit) > 1.5 * prefill("H100", "int8", KERNEL)  # W8A8 on int8 cores
    # BF16 matmuls, FP8 weights on an A100 (no FP8 cores: BF16 math) and int4 (W4A16) do not use it.
    assert prefill("H100", "bf16", slow_8bit) == prefill("H100", "bf16", KERNEL)
    assert prefill("A100-80GB", "fp8", slow_8bit) == prefill("A100-80GB", "fp8", KERNEL)
    assert prefill("H100", "int4", slow_8bit) == prefill("H100", "int4", KERNEL)
    with pytest.raises(ValueError):
        Efficiencies(gemm_compute_8bit=1.2)
    with pytest.raises(ValueError):
        Efficiencies(gemm_compute_8bit=-0.1)


def test_fit_splits_8bit_from_the_sentinel_and_stops_when_converged() -> None:
    from stoker.roofline.calibrate import coordinate_descent

    # From the 0 sentinel, fit_points starts the 8-bit share at gemm_compute, so the two can move apart.
    pts = [p for p in published.fit_points() if p.kind == "ttft"]
    grids = {"gemm_compute": [0.4, 0.6, 0.8], "gemm_compute_8bit": [0.4, 0.6, 0.8]}
    fitted = fit_points(pts, grids=grids)
    assert fitted.gemm_compute_8bit > 0
    # Early stop: more rounds than needed give the same answer as many more.
    def loss(e: Efficiencies) -> float:
        return (e.memory - 0.5) ** 2

    grid = {"memory": [0.3, 0.4, 0.5, 0.6]}
    assert coordinate_descent(loss, KERNEL, grid, rounds=2) == coordinate_descent(loss, KERNEL, grid, rounds=50)


def test_ceiling_is_never_below_a_public_measurement() -> None:
    for p in published.POINTS:
        assert published.ceiling_ratio(p) >= 1.0, p.label
        # The wall counts each cached K/V byte once, whatever the point's kernel does.
        assert published.ceiling_ratio(p) >= published.speed_ratio(p, Efficiencies.ideal()), p.label


def test_kv_read_factor_is_the_query_group_per_gpu() -> None:
    # costmodel.kv_read_factor: a kernel with one thread block per (sequence, query head) reads
    # its KV head once per query head (TensorRT-LLM's masked MHA, gpt_attention.md @138f96d;
    # gpt-fast's repeat_interleave); shared-read kernels (XQA, FlashAttention) once per group.
    from stoker.roofline.costmodel import kv_read_factor
    from stoker.roofline.modelspec import get_model_spec

    m70, m7 = get_model_spec("llama-2-70b"), get_model_spec("llama-2-7b")
    assert (m70.num_heads, m70.num_kv_heads, m7.num_heads, m7.num_kv_heads) == (64, 8, 32, 32)
    for tp in (1, 2, 4, 8):
        assert kv_read_factor(m70, tp, per_query_head=True) == 8  # 64/tp query heads over 8/tp KV heads
        assert kv_read_factor(m70, tp) == 1
        assert kv_read_factor(m7, tp, per_query_head=True) == 1  # MHA: groups of one
    # More GPUs than KV heads: each GPU holds one (replicated) KV head for its 64/16 query heads.
    assert kv_read_factor(m70, 16, per_query_head=True) == 4


def test_kv_per_query_head_prices_decode_reads_only() -> None:
    from stoker.roofline.costmodel import step_cost
    from stoker.roofline.workloads import static_batch_time_s

    kw = dict(batch=64, context_len=2048, weight_dtype="fp8", kv_dtype="fp8", tp=2, eff=ENGINE)
    shared = step_cost("llama-2-70b", "H100", **kw)
    per_head = step_cost("llama-2-70b", "H100", kv_per_query_head=True, **kw)
    assert per_head.kv_bytes == pytest.approx(8 * shared.kv_bytes)
    assert per_head.step_time_s > shared.step_time_s
    assert per_head.latency_floor_s == shared.latency_floor_s  # the wall reads each byte once
    # Prefill writes its K/V once either way; an MHA model is unchanged; the default is shared reads.
    pf = dict(kw, phase="prefill", batch=1)
    assert step_cost("llama-2-70b", "H100", kv_per_query_head=True, **pf).step_time_s == \
        step_cost("llama-2-70b", "H100", **pf).step_time_s
    kw7 = dict(kw, tp=1)
    assert step_cost("llama-2-7b", "H100", kv_per_query_head=True, **kw7).step_time_s == \
        step_cost("llama-2-7b", "H100", **kw7).step_time_s
    static = dict(batch=64, input_len=128, output_len=64, weight_dtype="fp8", kv_dtype="fp8", tp=2, eff=ENGINE)
    assert (static_batch_time_s("llama-2-70b", "H100", kv_per_query_head=True, **static)
            > static_batch_time_s("llama-2-70b", "H100", **static))


def test_points_carry_their_engines_kv_reads() -> None:
    # Every public point's engine reads each KV head once per query head (published.py KV_READS):
    # TensorRT-LLM v0.5/v0.6.1's masked MHA generation kernel, gpt-fast's repeat_interleave.
    assert all(p.kv_per_query_head for p in published.POINTS)
    assert published.PublicPoint("x", "llama-2-7b", "H100", 1, "bf16", "bf16", "decode", 1, 1, 1, 1.0,
                                 "s").kv_per_query_head is False
    # With it the 70B throughput rows, fitted and held out, stop being the 1.7-2x optimistic misses.
    rows = [p for p in published.POINTS if p.kind == "static" and p.model == "llama-2-70b"]
    assert len(rows) == 7
    for p in rows:
        assert 0.75 <= published.speed_ratio(p, ENGINE) <= 1.1, p.label
    long_out = [p for p in rows if p.output_len == 2048]
    assert all(published.speed_ratio(dataclasses.replace(p, kv_per_query_head=False), ENGINE) > 1.3
               for p in long_out)


def test_pattern_search_follows_a_diagonal_valley() -> None:
    # One-knob steps cannot move along a valley where two knobs must change together; the pair
    # steps of calibrate.pattern_search can (the engine fit's memory / gap / latency trade-off).
    from stoker.roofline.calibrate import coordinate_descent, pattern_search

    def loss(e: Efficiencies) -> float:
        return 100 * (e.memory - e.gemm_compute) ** 2 + (e.memory + e.gemm_compute - 1.0) ** 2

    grid = [round(0.1 * i, 1) for i in range(1, 11)]
    grids = {"memory": grid, "gemm_compute": grid}
    start = KERNEL.replace(memory=0.1, gemm_compute=0.1)
    assert coordinate_descent(loss, start, grids, rounds=10) == start  # stuck
    best = pattern_search(loss, start, grids)
    assert (best.memory, best.gemm_compute) == (0.5, 0.5)


def test_every_point_cites_a_source_and_a_known_kind() -> None:
    for p in published.POINTS:
        assert p.source.startswith("github.com/") and p.kind in published.KINDS
    with pytest.raises(ValueError):
        published.PublicPoint("x", "llama-2-7b", "H100", 1, "bf16", "bf16", "bogus", 1, 1, 1, 1.0, "s")


def test_speed_ratio_reads_the_same_way_for_latency() -> None:
    p = published.POINTS[-1]
    assert p.kind == "ttft"
    assert published.speed_ratio(p, KERNEL) == pytest.approx(p.measured / published.predict(p, KERNEL))


def test_profile_file_round_trip_and_errors(tmp_path) -> None:
    f = tmp_path / "mine.yaml"
    eff = ENGINE.replace(memory=0.66, comm_latency_s=5e-6, prefill_layer_overhead_s=1e-4)
    assert eff.gemm_compute_8bit == ENGINE.gemm_compute_8bit  # the FP8 share round-trips too
    save_profile(eff, f, name="mine", source="test")
    assert load_profile(f) == eff and get_profile(str(f)) == eff
    assert not list(tmp_path.glob(".mine.yaml.*"))  # no temp file left behind
    assert get_profile("kernel") == KERNEL and get_profile(None) == ENGINE
    (tmp_path / "flat.json").write_text('{"memory": 0.5}')
    assert get_profile(str(tmp_path / "flat.json")) == KERNEL.replace(memory=0.5)
    (tmp_path / "bad.yaml").write_text("efficiencies: {memroy: 0.5}\n")
    with pytest.raises(ValueError, match="unknown efficiency key"):
        load_profile(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("fastest")


def test_failed_profile_write_leaves_the_old_file_whole(tmp_path, monkeypatch) -> None:
    import os

    f = tmp_path / "p.yaml"
    save_profile(KERNEL, f)
    before = f.read_text()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        save_profile(ENGINE, f)
    assert f.read_text() == before and [x.name for x in tmp_path.iterdir()] == ["p.yaml"]


def test_moe_points_predicted_within_25_percent_under_the_ceiling() -> None:
    # Issue 33: published Mixture-of-Experts measurements (published.MOE_POINTS, each cited), kept out
    # of the fit. Every one sits under the ceiling; every one without a note (a named miss) is
    # predicted within 25% by the engine profile, and the engine profile beats kernel peaks on them.
    pts = published.MOE_POINTS
    assert len(pts) >= 10 and not set(pts) & set(published.POINTS)
    assert {p.model for p in pts} >= {"mixtral-8x7b", "qwen3-30b-a3b"}
    for p in pts:
        assert p.source.startswith(("github.com/", "buildkite.com/")) and p.kind in published.KINDS
        assert published.ceiling_ratio(p) >= 1.0, p.label
        if not p.note:
            assert abs(published.speed_ratio(p, ENGINE) - 1) <= 0.25, p.label
    engine, kernel = published.summary(pts, ENGINE), published.summary(pts, KERNEL)
    assert engine["within"] == 9 > kernel["within"]
    assert points_loss(pts, ENGINE) < points_loss(pts, KERNEL)


def test_moe_layer_floor_comes_from_cited_kernel_timings() -> None:
    # The engine profile's per-sparse-layer cost is the median residual of published fused-MoE
    # kernel timings over their experts' bytes; each timing is then predicted within 25%, the floor
    # lies inside the residuals' range, and the kernel profile (no floor) is optimistic on all.
    pts = moe_kernels.MOE_KERNEL_POINTS
    assert len(pts) >= 4 and all(p.source.startswith("github.com/") for p in pts)
    residuals = [moe_kernels.residual_s(p, ENGINE.memory) for p in pts]
    assert min(residuals) <= ENGINE.moe_layer_overhead_s <= max(residuals) and KERNEL.moe_layer_overhead_s == 0
    for p in pts:
        assert abs(moe_kernels.predict_us(p, ENGINE.memory, ENGINE.moe_layer_overhead_s) / p.measured_us - 1) <= 0.25
        assert moe_kernels.predict_us(p, 1.0, 0.0) < p.measured_us  # bytes at peak: a ceiling on speed


def test_moe_gaps_are_charged_per_sparse_layer_and_only_on_moe_models() -> None:
    from stoker.roofline.costmodel import step_cost

    def gaps(model: str, eff: Efficiencies) -> float:
        ops = step_cost(model, "H100", batch=1, context_len=256, eff=eff).ops
        return sum(op.time_s for op in ops if op.name == "moe_gaps")

    eff = ENGINE.replace(moe_layer_overhead_s=10e-6)
    assert gaps("qwen3-30b-a3b", eff) == pytest.approx(48 * 10e-6)
    assert gaps("llama-3-8b", eff) == 0.0 and gaps("qwen3-30b-a3b", eff.replace(moe_layer_overhead_s=0.0)) == 0.0
