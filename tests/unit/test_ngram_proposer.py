"""The n-gram proposer, speculative_config's validation and the vllm:spec_decode_* counters:
pure Python, no model."""

from __future__ import annotations

import argparse

import pytest

from stoker.config import SpeculativeConfig
from stoker.core.ngram_proposer import NgramProposer
from stoker.core.spec_decode_stats import SpecDecodingStats
from stoker.engine.args import add_engine_args, engine_kwargs


def test_the_longest_recurring_suffix_proposes_what_followed_it() -> None:
    p = NgramProposer(3, prompt_lookup_max=4, prompt_lookup_min=1)
    # suffix [1, 2, 3] occurs at 0..2 (followed by 9, 8, 7); suffix [3] alone recurs later at 6 (followed by 5)
    assert p.propose([1, 2, 3, 9, 8, 7, 3, 5, 1, 2, 3]) == [9, 8, 7]
    # of equally long matches the most recent wins
    assert p.propose([4, 5, 10, 11, 12, 4, 5, 20, 21, 4, 5]) == [20, 21, 4]
    assert p.propose([7, 8, 9, 7, 8]) == [9, 7, 8]
    # a loop shorter than k: the copy runs on into what it proposes (period 2, then 1)
    assert p.propose([3, 1, 2, 1, 2]) == [1, 2, 1]
    assert p.propose([9, 5, 5, 5]) == [5, 5, 5]
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert p.propose([6]) == [] and p.propose([]) == []


def test_prompt_lookup_min_and_max_bound_the_match() -> None:
    seq = [1, 2, 3, 50, 9, 3, 60, 2, 3]  # [2, 3] recurs once (followed by 50); [3] most recently at 5 (-> 60)
    assert NgramProposer(2, 4, 2).propose(seq) == [50, 9]
    assert NgramProposer(2, 1, 1).propose(seq) == [60, 2]  # max 1: only one-token suffixes count
    assert NgramProposer(2, 4, 3).propose(seq) == []  # no 3-token suffix recurs


def test_proposals_are_capped_by_what_may_still_be_emitted() -> None:
    p = NgramProposer(5, 4, 1)
    seq = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert p.propose(seq) == [3, 4, 5, 6, 7]
    assert p.propose(seq, max_tokens=2) == [3, 4]
    assert p.propose(seq, max_tokens=0) == []


def test_speculative_config_takes_vllms_keys_and_refuses_by_name() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 2})
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 3, 2)
    for values, message in (
        ({"method": "draft_model", "num_speculative_tokens": 3}, "'draft_model' needs \"model\""),
        ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not supported yet"),
        ({"method": "ngramm", "num_speculative_tokens": 3}, "'ngramm' is unknown"),
        ({"num_speculative_tokens": 3}, 'needs a "method"'),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 4},
         "must not exceed"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
         "keys draft_tensor_parallel_size are not supported"),
        ([1, 2], "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(values)


def test_the_flag_is_vllms_json() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4,
                                                         "prompt_lookup_max": 3}
    assert engine_kwargs(parser.parse_args(["--model", "m"]))["speculative_config"] is None
    for bad in ("{not json", '{"method": "eagle3", "num_speculative_tokens": 2}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", "--speculative-config", bad])


def test_counters_count_drafts_accepted_tokens_and_positions() -> None:
    s = SpecDecodingStats(3)
    s.observe(3, 2)
    s.observe(3, 0)
    s.observe(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.num_accepted_tokens_per_pos == [2, 2, 0]
    assert s.acceptance_rate == 0.5 and s.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    snap = s.snapshot()
    s.observe(1, 1)
    assert snap.num_drafts == 3 and snap.num_accepted_tokens_per_pos == [2, 2, 0]
    with pytest.raises(AssertionError):
        s.observe(2, 3)
