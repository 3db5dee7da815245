"""The live wall verdict: step shapes, the mixed-step cost, and the judgement of a step."""

from __future__ import annotations

import pytest

from stoker.core.step import SeqStep, StepMessage, StepShape
from stoker.roofline.costmodel import mixed_step_cost, step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import get_gpu
from stoker.roofline.live import WallModel
from stoker.roofline.modelspec import get_model_spec


def test_step_shape_counts_what_the_step_computes() -> None:
    step = StepMessage([
        SeqStep(1, [5], 99, [0], True),  # a decode at position 99: context 100
        SeqStep(2, [7], 9, [1], True),  # context 10
        SeqStep(3, [1, 2, 3, 4], 6, [2], True),  # a prefill chunk at positions 6..9: attends 7+8+9+10
    ])
    shape = step.shape()
    assert shape == StepShape(num_prefill_tokens=4, prefill_attended=34, num_decode_seqs=2, decode_context=110,
                              num_sampled=3)
    assert shape.kind == "mixed" and shape.num_tokens == 6
    assert StepMessage([SeqStep(1, [5], 3, [0], True)]).shape().kind == "decode"
    assert StepMessage([SeqStep(1, [5, 6], 0, [0], False)]).shape().kind == "prefill"


def test_a_verify_step_is_a_decode_of_one_plus_k_tokens() -> None:
    """Speculative decoding: the known token at position 99 and 3 drafts after it. The live wall
    counts 4 tokens, one context read (not a 4-token prefill chunk), as the k policy plans it."""
    from stoker.core.spec_k_policy import PlannedSeq, SpecKPolicy

    verify = StepMessage([SeqStep(1, [5, 6, 7, 8], 99, [0], True, draft_token_ids=(6, 7, 8))])
    shape = verify.shape()
    assert shape == StepShape(num_prefill_tokens=0, prefill_attended=0, num_decode_seqs=1, decode_context=100,
                              num_sampled=4, num_draft_tokens=3, draft_attended=101 + 102 + 103)
    assert shape.kind == "decode" and shape.num_tokens == 4
    assert SpecKPolicy.shape([PlannedSeq(100, 3)], 3) == shape  # what the policy priced is what ran
    m, g = get_model_spec("llama-3-8b"), get_gpu("H100")
    wall = WallModel(m, g, Efficiencies(), weight_dtype="bf16", kv_dtype="bf16")
    decode = wall.judge(StepShape(0, 0, 1, 100, 1), 0.0)  # 0 s: the modelled wall, no measurement
    v = wall.judge(shape, 0.0)
    assert v.kind == "decode" and v.wall == "memory"  # batch 1, 4 tokens: still reading weights
    assert decode.flops * 3.9 < v.flops < decode.flops * 4.1  # four tokens' matmuls
    assert decode.predicted_s < v.predicted_s < 1.1 * decode.predicted_s  # one weight read, not four
    as_prefill = wall.judge(StepShape(4, 4 * 99 + 10, 0, 0, 4), 0.0)  # how a verify step was priced before
    assert v.bytes > as_prefill.bytes  # the context's K/V is read


def test_a_pure_decode_step_costs_what_step_cost_says() -> None:
    m, g = get_model_spec("llama-3-8b"), get_gpu("H100")
    whole = step_cost(m, g, phase="decode", batch=8, context_len=1024)
    mixed = mixed_step_cost(m, g, prefill_tokens=0, prefill_attended=0, decode_seqs=8, decode_context=8 * 1024,
                            logits_rows=8)
    assert mixed.step_time_s == pytest.approx(whole.step_time_s, rel=1e-9)
    assert mixed.bytes == pytest.approx(whole.bytes, rel=1e-9) and mixed.flops == pytest.approx(whole.flops, rel=1e-9)


def test_a_mixed_step_reads_the_weights_once() -> None:
    m, g = get_model_spec("llama-3-8b"), get_gpu("H100")
    kw = dict(prefill_attended=512 * 513 // 2, decode_context=8 * 1024)
    both = mixed_step_cost(m, g, prefill_tokens=512, decode_seqs=8, logits_rows=9, **kw)
    prefill = mixed_step_cost(m, g, prefill_tokens=512, prefill_attended=kw["prefill_attended"], decode_seqs=0,
                              decode_context=0, logits_rows=1)
    decode = mixed_step_cost(m, g, prefill_tokens=0, prefill_attended=0, decode_seqs=8,
                             decode_context=kw["decode_context"], logits_rows=8)
    assert both.weight_bytes == pytest.approx(prefill.weight_bytes)  # not twice
    assert both.flops == pytest.approx(prefill.flops + decode.flops, rel=1e-6)
    assert both.step_time_s < prefill.step_time_s + decode.step_time_s


def test_judging_a_step() -> None:
    m, g = get_model_spec("llama-3-8b"), get_gpu("H100")
    wall = WallModel(m, g, Efficiencies(), weight_dtype="bf16", kv_dtype="bf16")
    shape = StepShape(0, 0, 1, 512, 1)
    predicted = mixed_step_cost(m, g, prefill_tokens=0, prefill_attended=0, decode_seqs=1, decode_context=512,
                                logits_rows=1).step_time_s
    v = wall.judge(shape, 2 * predicted)  # twice as slow as modelled
    assert v.wall == "memory" and v.kind == "decode"
    assert v.measured_over_predicted == pytest.approx(2.0)
    assert v.mbu == pytest.approx(v.bytes / (2 * predicted) / g.hbm_bytes_per_s)
    assert 0 < v.mbu < 1 and 0 < v.mfu < v.mbu  # batch-1 decode: far from the compute wall
    assert wall.judge(shape, 5 * predicted).wall == "overhead"  # held by what the model does not price
    big = StepShape(8192, 8192 * 8193 // 2, 0, 0, 1)
    big_predicted = mixed_step_cost(m, g, prefill_tokens=8192, prefill_attended=big.prefill_attended, decode_seqs=0,
                                    decode_context=0, logits_rows=1).step_time_s
    v = wall.judge(big, big_predicted)
    assert v.wall == "compute" and v.kind == "prefill" and v.mfu > v.mbu


def test_the_log_line_says_the_wall_in_words() -> None:
    from prometheus_client import CollectorRegistry

    from stoker.server.observe.wall_metrics import WallMetrics

    m, g = get_model_spec("llama-3-8b"), get_gpu("H100")
    metrics = WallMetrics(CollectorRegistry(), "m")
    metrics.observe(StepShape(0, 0, 4, 4096, 4), 0.01)  # no model yet: nothing counted
    assert metrics.summary() is None
    metrics.set_model(WallModel(m, g, Efficiencies(), weight_dtype="bf16"))
    predicted = mixed_step_cost(m, g, prefill_tokens=0, prefill_attended=0, decode_seqs=4, decode_context=4096,
                                logits_rows=4).step_time_s
    for _ in range(3):
        metrics.observe(StepShape(0, 0, 4, 4096, 4), 1.25 * predicted)
    text = metrics.summary()
    assert text is not None and text.startswith("decode: ") and "% of the memory wall; 1.25x of prediction" in text
    for _ in range(10):  # most steps of the window now take 10x their prediction: overhead
        metrics.observe(StepShape(0, 0, 4, 4096, 4), 10 * predicted)
    assert metrics.summary().startswith("decode: overhead-bound; ")


def test_the_live_wall_prices_moe_steps_by_the_experts_the_batch_touches() -> None:
    # Issue 33: the server builds its WallModel from the checkpoint's config.json (engine/wall_model.py,
    # a fake engine here: no torch), and every step's decode count is the B of E x (1 - (1 - k/E)^B).
    from types import SimpleNamespace

    from stoker.roofline.presets import PRESETS
    from stoker.engine.wall_model import build_wall_model

    config = {k: v for k, v in PRESETS["qwen3-30b-a3b"].items() if not k.startswith("published") and k != "source"}
    info = SimpleNamespace(runner=SimpleNamespace(device_type="cuda", device_name="NVIDIA H100 80GB HBM3",
                                                  dtype="torch.bfloat16", quantization=None),
                           cache_config=SimpleNamespace(fp8_kv=False), hf_config=config, model_path="/ckpt/qwen3-moe",
                           tensor_parallel_size=1)
    wall = build_wall_model(info)
    assert wall is not None and wall.spec.is_moe and wall.spec.num_experts == 128
    spec, g = wall.spec, get_gpu("H100")

    def judged(b: int) -> float:
        shape = StepShape(num_prefill_tokens=0, prefill_attended=0, num_decode_seqs=b, decode_context=b * 512,
                          num_sampled=b)
        v = wall.judge(shape, 0.01)
        cost = mixed_step_cost(spec, g, prefill_tokens=0, prefill_attended=0, decode_seqs=b, decode_context=b * 512,
                               logits_rows=b, eff=wall.eff)
        assert v.bytes == pytest.approx(cost.bytes) and v.predicted_s == pytest.approx(cost.step_time_s)
        assert cost.weight_bytes == pytest.approx(spec.decode_weight_bytes(b, "bf16"))  # the step's B
        return cost.weight_bytes

    one, many = judged(1), judged(64)
    assert one < many  # 8 experts a layer at B=1, ~126 of 128 at B=64
    assert many < spec.weight_bytes("bf16")  # 64 tokens touch ~126 of 128 experts, never more than all
