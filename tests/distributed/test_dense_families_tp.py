"""Tensor parallelism over gloo for the families whose layers TP must cut in a new way:
Phi-3's stacked qkv_proj / gate_up_proj (each rank reads its q rows, its k rows and its v rows
of the one tensor) and OLMo 2's q/k RMSNorm over the whole projection (an all-reduce of the
sums of squares; at TP=4 each of the 2 KV heads is on two ranks, and counted once); Granite's
multipliers and SmolLM3's NoPE layers at TP=2. TP=N must give TP=1's tokens and logprobs."""

from __future__ import annotations

import pytest

from stoker import SamplingParams
from tests.distributed.test_tensor_parallel import engine
from tests.model.test_dense_families import CONFIGS, PHI3_SHORT

PROMPTS = [[1, 17, 300, 42, 7, 99], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [600, 2, 3]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)


def run(llm) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    llm.engine.check_integrity()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


@pytest.mark.parametrize("arch, overrides, tp", [
    (*PHI3_SHORT, 2),
    ("olmo2", {}, 2),
    ("olmo2", {}, 4),  # 2 KV heads over 4 ranks: each k column held twice
    (*CONFIGS["granite"], 2),  # the multipliers with a tied LM head split by vocabulary
    (*CONFIGS["smollm3"], 2),  # a NoPE layer with a window beside a rotary one
], ids=["phi3-stacked", "olmo2-qknorm", "olmo2-tp4-replicated-k", "granite-multipliers", "smollm3-nope"])
def test_tp_equals_tp1(tiny_checkpoints, arch: str, overrides: dict, tp: int) -> None:
    path = tiny_checkpoints(arch, **overrides)
    with engine(path) as llm:
        want_tokens, want_logprobs = run(llm)
    with engine(path, tensor_parallel_size=tp) as llm:
        tokens, logprobs = run(llm)
        assert llm.engine.executor.driver_runner.tp.world_size == tp
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=1e-4)


def test_phi3_lora_on_stacked_projections_at_tp2_equals_peft(tiny_checkpoints, tmp_path) -> None:
    """A Phi-3 adapter on the stacked qkv_proj / gate_up_proj at TP=2: each rank holds its rows
    of the q, k and v (gate, up) parts of the stacked B."""
    from stoker import LoRARequest
    from tests.model.helpers import make_adapter, peft_greedy

    path = tiny_checkpoints(*PHI3_SHORT[:1], **PHI3_SHORT[1])
    adapter = make_adapter(path, tmp_path / "a", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], 8, seed=5)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with engine(path, tensor_parallel_size=2, enable_lora=True, max_lora_rank=8) as llm:
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(adapter)))
        llm.engine.check_integrity()
    assert out[0].outputs[0].token_ids == peft_greedy(path, adapter, PROMPTS[0], 8)
