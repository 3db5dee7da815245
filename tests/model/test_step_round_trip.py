"""The step round trip through a real runner: the message's optional parts (KV block copies,
draft tokens) and what comes back (DESIGN.md, seam 21)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.core.step import SampleSpec, SeqStep, StepMessage


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=4 << 20)


def test_kv_copies_copy_blocks_in_every_layer_before_the_forward(llm: LLM) -> None:
    runner = llm.engine.executor.driver_runner
    for i, (k, v) in enumerate(runner.kv_caches):
        k[3].fill_(float(i + 1))
        v[3].fill_(-float(i + 1))
        k[5].zero_()
        v[5].zero_()
    # A one-token step on block 0 that also copies block 3 onto block 5.
    step = StepMessage([SeqStep(-7, [1], 0, [0], True)], {-7: SampleSpec(SamplingParams(max_tokens=1), 0, 0)},
                       kv_copies=((3, 5),))
    result = runner.execute(step)
    runner.release(-7)
    assert list(result.sampled) == [-7] and len(result.sampled[-7].token_ids) == 1
    for i, (k, v) in enumerate(runner.kv_caches):
        assert torch.equal(k[5], k[3]) and torch.equal(v[5], v[3]) and float(k[5].flatten()[0]) == i + 1
    with pytest.raises(ValueError, match="outside"):
        runner.copy_blocks(((0, 10**6),))


def test_a_runner_refuses_draft_tokens_it_cannot_verify(llm: LLM) -> None:
    runner = llm.engine.executor.driver_runner
    step = StepMessage([SeqStep(-8, [1, 5], 0, [0], True, draft_token_ids=(5,))],
                       {-8: SampleSpec(SamplingParams(max_tokens=2), 0, 0)})
    assert step.seqs[0].num_sampled == 2
    with pytest.raises(NotImplementedError, match="draft tokens"):
        runner.execute(step)


def test_an_engine_with_a_draft_fails_that_request_and_stays_whole(llm: LLM) -> None:
    """A proposer-less engine never plans drafts; one planted on a sequence fails its request
    (nothing of it cached, its blocks freed), and the engine serves the next call as before."""
    from stoker.engine.llm_engine import StepFailed

    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = llm.generate("Draft me", greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request(engine.input_processor.process("d", "Draft me", greedy))
    engine.step()  # the prompt
    (seq,) = engine.requests["d"].seqs
    seq.draft_token_ids = [base[1], base[2]]
    with pytest.raises(StepFailed, match="draft tokens"):
        engine.step()
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate("Draft me", greedy, use_tqdm=False)[0].outputs[0].token_ids == base
