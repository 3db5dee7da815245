"""The grammar over drafted tokens (speculative decoding): one masked row per drafted position
and the bonus one, up to the first draft the grammar refuses; a walk that leaves the matcher
where it was; only kept tokens advance it; a draft model's argmax within the grammar."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoker.structured.draft_mask import DraftMask
from stoker.structured.grammar import GrammarCache, GrammarMatchers
from stoker.structured.spec import StructuredOutputs

DIGITS = StructuredOutputs(regex="[0-9]+")


@pytest.fixture(scope="module")
def matchers(tiny_llama: Path) -> GrammarMatchers:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return GrammarMatchers(GrammarCache(tok, len(tok), (tok.eos_token_id,)))


@pytest.fixture(scope="module")
def ids(tiny_llama: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    one = {c: tok.encode(c, add_special_tokens=False) for c in "123a"}
    assert all(len(v) == 1 for v in one.values()), one  # single-character tokens in the tiny vocabulary
    return {c: v[0] for c, v in one.items()} | {"eos": tok.eos_token_id}


def _masked_rows(m: GrammarMatchers, num_rows: int, groups) -> torch.Tensor:
    logits = torch.zeros(num_rows, m.cache.info.vocab_size)
    m.mask_drafts(logits, groups)
    return torch.isinf(logits)  # (num_rows, V): True where the grammar forbids


def test_rows_are_masked_up_to_the_first_refused_draft_and_the_walk_rolls_back(matchers, ids) -> None:
    seq = 1
    drafts = (ids["1"], ids["2"], ids["a"], ids["3"])  # "a" is refused at draft 2
    inf = _masked_rows(matchers, 6, [(1, seq, DIGITS, drafts)])  # rows 1..5 are the sequence's
    assert not inf[0].any()  # another sequence's row
    assert not inf[1, ids["1"]] and inf[1, ids["eos"]]  # before any digit: a digit, no end
    assert not inf[2, ids["2"]] and not inf[2, ids["eos"]]
    assert inf[3, ids["a"]] and not inf[3, ids["3"]]  # the refused draft's own row forbids it
    assert not inf[4].any() and not inf[5].any()  # after it: never kept, left free
    # the walk changed nothing: the matcher still stands before the first digit
    assert matchers.allowed_prefix(seq, DIGITS, [ids["eos"]]) == 0
    assert matchers.allowed_prefix(seq, DIGITS, list(drafts)) == 2
    matchers.accept_tokens(seq, DIGITS, [ids["1"], ids["2"]])  # verification kept two
    assert matchers.allowed_prefix(seq, DIGITS, [ids["eos"]]) == 1
    with pytest.raises(RuntimeError, match="rejected token"):
        matchers.accept_tokens(seq, DIGITS, [ids["a"]])  # a kept token the mask forbade: a bug, loud
    matchers.release(seq)


def test_a_drafted_stop_token_ends_the_walk(matchers, ids) -> None:
    seq = 2
    matchers.accept_tokens(seq, DIGITS, [ids["1"]])
    inf = _masked_rows(matchers, 3, [(0, seq, DIGITS, (ids["eos"], ids["2"]))])
    assert not inf[0, ids["eos"]] and not inf[1:].any()  # after the stop token: the output ends
    assert matchers.allowed_prefix(seq, DIGITS, [ids["eos"], ids["2"]]) == 1
    matchers.release(seq)


def test_drafts_that_finish_the_reasoning_marker_start_the_grammar(matchers, ids) -> None:
    seq = 3
    gated = StructuredOutputs(regex="[0-9]+", enforce_after=(11, 12))
    drafts = (30, 11, 12, ids["1"], ids["a"])
    inf = _masked_rows(matchers, 6, [(0, seq, gated, drafts)])
    assert not inf[:3].any()  # thinking: free up to and including the marker's last token
    assert inf[3, ids["a"]] and not inf[3, ids["1"]]  # the grammar from the token after it
    assert inf[4, ids["a"]] and not inf[5].any()
    assert seq not in matchers.matchers and not matchers.gates[seq].open  # drafts open no real gate
    matchers.accept_tokens(seq, gated, [30, 11, 12, ids["1"]])  # kept: the marker, then a digit
    assert seq in matchers.matchers and matchers.allowed_prefix(seq, gated, [ids["a"]]) == 0
    matchers.release(seq)


def test_a_draft_models_argmax_stays_within_the_grammar(matchers, ids) -> None:
    seq = 4
    vocab = matchers.cache.info.vocab_size
    logits = torch.zeros(2, vocab)
    logits[:, ids["a"]] = 5.0  # the unmasked draft would say "a"
    logits[:, ids["2"]] = 1.0
    mask = DraftMask(matchers, {seq: DIGITS})  # row 1: a sequence without a grammar
    assert mask.argmax([seq, 99], logits).tolist() == [ids["2"], ids["a"]]
    assert logits[0, ids["a"]] == 5.0  # the draft model's tensor is untouched
    assert matchers.allowed_prefix(seq, DIGITS, [ids["eos"]]) == 1  # advanced by its draft "2"
    mask.close()
    assert matchers.allowed_prefix(seq, DIGITS, [ids["eos"]]) == 0  # rolled back
    matchers.release(seq)
