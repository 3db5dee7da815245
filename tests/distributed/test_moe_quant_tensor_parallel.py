"""Online-quantized experts under tensor parallelism (CPU, gloo): each rank quantizes its part
of every expert as it is read (its rows of gate and up, its columns of down, whose rows then get
scales of their own part), so TP=2 is not bit-equal to TP=1; what must hold, as for dense
models (test_tensor_parallel.test_online_fp8_at_tp2_is_as_close_to_float_as_tp1), is that
TP=2's first-token log-probabilities are about as close to the float model's as TP=1's.
(Pre-quantized experts under tensor parallelism are refused: tests/model/test_moe_quantization.py.)"""

from __future__ import annotations

import pytest

from stoker import SamplingParams
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_quant import QuantizedMoEMethod
from tests.distributed.test_tensor_parallel import PROMPTS, engine

QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True,
                 num_hidden_layers=3, mlp_only_layers=[1])


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_online_quantized_experts_at_tp2_are_as_close_to_float_as_tp1(tiny_checkpoints, quantization: str) -> None:
    path = tiny_checkpoints("qwen3_moe", **QWEN3_MOE)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    def first_logprobs(**kw) -> list[dict[int, float]]:
        with engine(path, **kw) as llm:
            if kw.get("tensor_parallel_size"):
                moes = [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, FusedMoE)]
                assert moes and all(isinstance(m.method, QuantizedMoEMethod) and m.is_split for m in moes)
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    def max_gap(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
        return max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in x.keys() & y.keys())

    ref = first_logprobs()
    tp1 = max_gap(ref, first_logprobs(quantization=quantization))
    tp2 = max_gap(ref, first_logprobs(quantization=quantization, tensor_parallel_size=2))
    print(f"{quantization}: max first-token logprob gap to float, TP=1 {tp1:.3f}, TP=2 {tp2:.3f}")
    # measured: int8 0.032 / 0.036, fp8 0.364 / 0.331 (TP=1 / TP=2): FP8 on this tiny random model
    # sits above the dense test's absolute 0.25 already at TP=1, so the bound is relative only
    assert tp2 < 2 * tp1 + 0.05, (tp1, tp2)
