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


def test_a_runner_verifies_draft_tokens_in_one_forward(llm: LLM) -> None:
    """A step with drafts samples 1 + len(drafts) rows and keeps the drafts that are the
    greedy argmax, then one token: a right draft is kept, a wrong one replaced."""
    runner = llm.engine.executor.driver_runner
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": [1, 5, 9]}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    prompt = SeqStep(-8, [1, 5, 9], 0, [0], True)
    first = runner.execute(StepMessage([prompt], {-8: SampleSpec(greedy, 0, 0)})).sampled[-8].token_ids
    assert first == want[:1]
    wrong = next(t for t in range(100) if t not in want[:4])
    for drafts, kept in (((want[1], want[2]), want[1:4]), ((want[1], wrong), want[1:3]), ((wrong,), want[1:2])):
        step = StepMessage([SeqStep(-8, [want[0], *drafts], 3, [0], True, draft_token_ids=drafts)],
                           {-8: SampleSpec(greedy, 0, 1)})
        assert step.seqs[0].num_sampled == 1 + len(drafts)
        assert runner.execute(step).sampled[-8].token_ids == kept
    runner.release(-8)


def test_an_engine_with_a_planted_draft_verifies_it_and_stays_whole(llm: LLM) -> None:
    """A proposer-less engine never plans drafts; one planted on a sequence is verified like a
    proposer's (a wrong one rolls back), and the output is what no draft gives."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = llm.generate("Draft me", greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request(engine.input_processor.process("d", "Draft me", greedy))
    engine.step()  # the prompt
    (seq,) = engine.requests["d"].seqs
    seq.draft_token_ids = [base[1], next(t for t in range(100) if t not in base[:3])]
    engine.step()  # keeps base[1], replaces the wrong draft with base[2]
    assert seq.output_token_ids == base[:3] and seq.num_computed_tokens == seq.num_tokens - 1
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == base
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
