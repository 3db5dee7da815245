"""The suffix tree and the suffix proposer (SuffixDecoding): counts, matching, the most frequent
continuation, the depth bound, the spec factor and probability cut, and FIFO eviction."""

from __future__ import annotations

import random

import pytest

from stoker.config import SpeculativeConfig
from stoker.core.suffix_proposer import SuffixProposer, speculate_in_sequence
from stoker.core.suffix_tree import SuffixTree


def _count_naive(seqs: list[list[int]], path: list[int], depth: int) -> int:
    if len(path) > depth:
        return 0
    return sum(1 for s in seqs for i in range(len(s) - len(path) + 1) if s[i : i + len(path)] == path)


def test_counts_are_occurrences_of_every_substring_up_to_the_depth() -> None:
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    tree = SuffixTree(5)
    for s in seqs:
        tree.add(s)
    for _ in range(400):
        s = rng.choice(seqs)
        i = rng.randrange(len(s))
        path = s[i : i + rng.randrange(1, 7)]
        assert tree.count(path) == _count_naive(seqs, path, 5), path
    assert tree.count([9]) == 0


def test_the_most_frequent_continuation_is_drafted_with_its_frequency() -> None:
    tree = SuffixTree(8)
    tree.add([1, 2, 3, 4])
    tree.add([1, 2, 3, 4])
    tree.add([1, 2, 5, 6])
    d = tree.speculate([9, 1, 2], max_tokens=4, max_spec_factor=2.0, min_token_prob=0.0)
    assert d.token_ids == [3, 4] and d.match_len == 2
    assert d.probs == pytest.approx([2 / 3, 2 / 3])
    # The probability cut: 2/3 is below 0.7, nothing is drafted
    assert tree.speculate([1, 2], 4, 2.0, 0.7).token_ids == []


def test_draft_length_is_bounded_by_spec_factor_max_tokens_and_depth() -> None:
    seq = list(range(100, 130))
    tree = SuffixTree(10)
    tree.add(seq)
    assert tree.speculate([100, 101], 20, 1.0, 0.1).token_ids == [102, 103]  # factor 1: as long as the match
    assert tree.speculate([100, 101], 20, 2.5, 0.1).token_ids == [102, 103, 104, 105, 106]
    assert tree.speculate([100, 101], 3, 9.0, 0.1).token_ids == [102, 103, 104]  # max_tokens
    # Depth 10: the 1-token match "101" leaves 9 tokens of path (the 2-token match only 8): it wins
    assert tree.speculate([100, 101], 20, 9.0, 0.1).token_ids == seq[2:11]
    assert tree.speculate([5, 6], 20, 9.0, 0.1).token_ids == []  # no match


def test_a_longer_match_wins_ties_and_context_beyond_the_depth_is_ignored() -> None:
    tree = SuffixTree(4)
    tree.add([7, 8, 9, 1])
    tree.add([3, 8, 9, 2])
    tree.add([7, 8, 9, 1])
    # "8 9" is followed by 1 twice and 2 once; "7 8 9" only by 1
    assert tree.speculate([7, 8, 9], 1, 1.0, 0.1).token_ids == [1]
    assert tree.speculate([0, 0, 0, 0, 0, 3, 8, 9], 1, 1.0, 0.1).probs == [1.0]  # "3 8 9" -> 2? no: depth 4
    assert tree.speculate([0, 0, 0, 0, 0, 3, 8, 9], 1, 1.0, 0.1).token_ids == [2]


def test_remove_undoes_add_and_frees_the_nodes() -> None:
    rng = random.Random(2)
    a = [rng.randrange(6) for _ in range(50)]
    b = [rng.randrange(6) for _ in range(50)]
    tree = SuffixTree(6)
    tree.add(a)
    nodes_a = tree.num_nodes
    tree.add(b)
    nodes_ab = tree.num_nodes
    tree.remove(b)
    # b's own nodes go; paths of a that b had split stay spelled out (no re-joining on removal)
    assert nodes_a <= tree.num_nodes < nodes_ab
    for i in range(len(a) - 3):
        assert tree.count(a[i : i + 3]) == _count_naive([a], a[i : i + 3], 6)
    tree.remove(a)
    assert tree.num_nodes == 0 and not tree.root.children


def test_proposer_learns_finished_outputs_and_evicts_the_oldest() -> None:
    p = SuffixProposer(4, max_tree_depth=16, max_cached_requests=2, max_spec_factor=4.0)
    answer = [50, 51, 52, 53, 54, 55]
    assert p.propose_tokens([1, 2, 50, 51]).token_ids == []  # nothing recurs yet
    p.finish(1, answer)
    assert p.propose_tokens([1, 2, 50, 51]).token_ids == [52, 53, 54, 55]  # a recent request's output
    p.finish(1, answer)  # the same sequence twice counts once
    p.finish(2, [60, 61, 62])
    assert p.num_cached_requests == 2 and p.propose_tokens([50, 51], 2).token_ids == [52, 53]
    p.finish(3, [70, 71, 72])  # evicts request 1
    assert p.num_cached_requests == 2 and p.propose_tokens([1, 2, 50, 51]).token_ids == []
    off = SuffixProposer(4, max_cached_requests=0)
    off.finish(1, answer)
    assert off.num_cached_requests == 0 and off.propose_tokens([50, 51]).token_ids == []


def test_the_sequence_itself_drafts_its_most_frequent_continuation() -> None:
    # "1 2" was followed by 3 twice and by 4 once, the latest being 4: n-gram lookup would draft 4
    tokens = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    d = speculate_in_sequence(tokens, 24, 1, 1.0, 0.1)
    assert d.token_ids == [3]
    # A loop: drafts as long as k, the spec factor and the depth allow
    loop = [5, 6, 7] * 8
    assert speculate_in_sequence(loop, 24, 5, 1.0, 0.1).token_ids == [5, 6, 7, 5, 6]
    assert speculate_in_sequence(loop, 4, 5, 1.0, 0.1).token_ids == [5, 6]  # match + draft <= depth 4
    assert speculate_in_sequence([1, 2, 3], 24, 5, 1.0, 0.1).token_ids == []
    p = SuffixProposer(3)
    assert p.propose_tokens(loop, 0).token_ids == [] and p.propose_tokens(loop, 2).token_ids == [5, 6]


def test_config_takes_vllms_suffix_keys_and_defaults() -> None:
    c = SpeculativeConfig.from_dict({"method": "suffix"})
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob, c.dynamic) == (24, 24, 10000, 1.0, 0.1, True)
    c = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 8, "dynamic": False})
    assert c.num_speculative_tokens == 8 and not c.dynamic
    for values, message in (
        ({"method": "suffix", "prompt_lookup_max": 3}, "keys prompt_lookup_max are not supported for method 'suffix'"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth must be an integer >= 1"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "max_cached_requests must be an integer >= 0"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}, "max_spec_factor must be a number >= 0"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, r"min_token_prob must be in \[0, 1\]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "dynamic": "yes"}, "dynamic must be true or false"),
    ):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(values)
