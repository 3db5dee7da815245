"""Speculative decoding under tensor parallelism on CPU over gloo: the step message carries the
drafts to every rank, every rank runs the 1 + k token verify chunk on its shard, rank 0 verifies.
Greedy tokens equal TP=1's (with and without drafts) while drafts fire and are accepted, and a
seeded sampled request gives TP=1's tokens too. A draft model and an EAGLE-3 head draft on every
rank, sharded over the target's group: they propose what they propose at TP=1 (the counters
match), so the tokens match too."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from stoker import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "dynamic": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "dynamic": False}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 6, list(range(40, 75)), [300, 301, 302] * 10 + [7, 8]]
PARAMS = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=32, temperature=0.8, seed=11, ignore_eos=True)]


def _generate(path: Path, spec: dict | None, tp: int, params: list[SamplingParams] = PARAMS,
              ks: list[int] | None = None) -> tuple[list[list[int]], tuple[int, int]]:
    """The first len(params) prompts' tokens, and (draft tokens verified, accepted). `ks`: the k of
    each step, cycled (as the cost model would choose it: tests/model/helpers.py ScriptedK)."""
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 22, max_model_len=256, device="cpu", tensor_parallel_size=tp,
              speculative_config=spec, max_num_seqs=8)
    if ks is not None:
        from tests.model.helpers import ScriptedK

        llm.engine.spec_k_policy = ScriptedK(ks)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[: len(params)]], params, use_tqdm=False)
        llm.engine.check_integrity()
        sd = llm.engine.stats().spec_decoding
        counts = (sd.num_draft_tokens, sd.num_accepted_tokens) if sd is not None else (0, 0)
        return [o.outputs[0].token_ids for o in outs], counts
    finally:
        llm.shutdown()


def _run(path: Path, spec: dict | None, tp: int) -> tuple[list[list[int]], int]:
    tokens, (_, accepted) = _generate(path, spec, tp)
    return tokens, accepted


@pytest.fixture(scope="module")
def plain(tiny_checkpoints) -> list[list[int]]:
    """TP=1 without speculation: the tokens every run here is held to."""
    return _run(tiny_checkpoints("llama"), None, 1)[0]


def test_tp2_speculative_greedy_equals_tp1(tiny_checkpoints, plain: list[list[int]]) -> None:
    path = tiny_checkpoints("llama")
    ngram1, accepted1 = _run(path, NGRAM, 1)
    ngram2, accepted2 = _run(path, NGRAM, 2)
    assert ngram2[:2] == ngram1[:2] == plain[:2]  # greedy rows: exactly the tokens without drafts
    assert ngram2[2] == ngram1[2]  # the seeded sampled row: TP=1's tokens with the same drafts
    assert accepted2 == accepted1 > 0
    suffix2, accepted = _run(path, SUFFIX, 2)
    assert suffix2[:2] == plain[:2] and accepted > 0


def test_tp2_draft_model_and_eagle3_equal_tp1(tiny_checkpoints, plain: list[list[int]], tmp_path: Path) -> None:
    """The target drafting for itself, sharded or whole on each rank, accepts every greedy draft at
    TP=2 (a wrong shard or a rank feeding other tokens would not); an EAGLE-3 head (random weights over a draft
    vocabulary of the target's two most frequent tokens: it drafts, and is accepted at times) proposes and has accepted at TP=2 exactly what it does at TP=1, and the
    seeded sampled row gets TP=1's tokens."""
    from tests.model.test_eagle3 import write_eagle3_head

    path = tiny_checkpoints("llama")
    itself = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3, "dynamic": False}
    for whole in (False, True):  # sharded (the default), then whole on each rank (draft_tensor_parallel_size 1)
        spec = {**itself, "draft_tensor_parallel_size": 1} if whole else itself
        # sharded: k chosen per step, 0 at times (no draft forward on any rank, the caches catch up later)
        ks = None if whole else [0, 0, 3, 0, 1, 3]
        tokens, (drafted, accepted) = _generate(path, {**spec, "dynamic": ks is not None}, 2, PARAMS[:2], ks)
        assert tokens == plain[:2] and accepted == drafted > 0, whole
    # a draft vocabulary of the two tokens the target emits most: random weights choose between them
    common = [t for t, _ in Counter(t for row in plain for t in row).most_common(2)]
    head = write_eagle3_head(tmp_path / "eagle3", path, kept=common, eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    eagle = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "dynamic": False}
    tokens1, counts1 = _generate(path, eagle, 1)
    tokens2, counts2 = _generate(path, eagle, 2)
    assert tokens2[:2] == plain[:2] and tokens2 == tokens1
    assert counts2 == counts1 and counts2[1] > 0


def test_finished_sequences_reach_the_other_ranks_drafters() -> None:
    """Rank 0 alone sees a sequence finish: the ids go to the other ranks before the next step,
    in one message, so their drafters drop the sequence's state (EAGLE-3's carried rows, the
    draft's skipped positions) instead of keeping it for the life of the server."""
    from types import SimpleNamespace

    from stoker.executor.distributed import DistributedExecutor

    sent: list = []
    released_on_rank0: list[int] = []
    ex = DistributedExecutor.__new__(DistributedExecutor)
    ex.tp = SimpleNamespace(broadcast_object=sent.append)
    ex._failure, ex._closing, ex._released = None, False, []
    ex.driver_runner = SimpleNamespace(drafter=object(), release=released_on_rank0.append)
    ex.release(5)
    ex.release(9)
    assert released_on_rank0 == [5, 9] and sent == []  # nothing sent until the next step
    ex._send_released()
    ex._send_released()
    assert sent == [("release", [5, 9])]
    ex.driver_runner.drafter = None  # no runner drafter: nothing for the other ranks to drop
    ex.release(11)
    ex._send_released()
    assert sent == [("release", [5, 9])]
