"""Structured outputs after the reasoning (issue 32, part 3): a spec with `enforce_after` leaves a
sequence's row free until the marker's tokens have been sampled, then masks from the next token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoker.structured.grammar import GrammarCache, GrammarMatchers, _Gate
from stoker.structured.spec import StructuredOutputs


@pytest.fixture(scope="module")
def matchers(tiny_llama: Path) -> GrammarMatchers:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return GrammarMatchers(GrammarCache(tok, len(tok), (tok.eos_token_id,)))


def _masked(m: GrammarMatchers, seq_id: int, spec: StructuredOutputs) -> bool:
    logits = torch.zeros(1, m.cache.info.vocab_size)
    m.mask(logits, [(0, seq_id, spec)])
    return bool(torch.isinf(logits).any())


def test_gate_opens_on_the_whole_marker_only() -> None:
    gate = _Gate((7, 8, 9))
    for t in (7, 8, 1, 9, 8, 9, 7, 7, 8):
        gate.feed(t)
        assert not gate.open, t
    gate.feed(9)
    assert gate.open
    single = _Gate((5,))
    single.feed(4)
    assert not single.open
    single.feed(5)
    assert single.open


def test_mask_waits_for_the_marker(matchers: GrammarMatchers) -> None:
    marker = (11, 12)
    spec = StructuredOutputs(regex="[0-9]+", enforce_after=marker)
    seq = 1
    for token in (11, 30, 12, 11):  # thinking: never masked, whatever is sampled
        assert not _masked(matchers, seq, spec)
        matchers.accept(seq, token)
    assert not _masked(matchers, seq, spec)
    matchers.accept(seq, 12)  # 11, 12: the reasoning has ended
    assert _masked(matchers, seq, spec)
    matchers.release(seq)
    assert seq not in matchers.gates and seq not in matchers.matchers


def test_a_spec_without_marker_masks_from_the_start(matchers: GrammarMatchers) -> None:
    assert _masked(matchers, 2, StructuredOutputs(regex="[0-9]+"))
    assert 2 not in matchers.gates
    matchers.release(2)


def test_gated_and_plain_rows_share_a_step(matchers: GrammarMatchers) -> None:
    gated = StructuredOutputs(regex="[0-9]+", enforce_after=(11,))
    plain = StructuredOutputs(regex="[0-9]+")
    logits = torch.zeros(2, matchers.cache.info.vocab_size)
    matchers.mask(logits, [(0, 3, gated), (1, 4, plain)])
    assert not torch.isinf(logits[0]).any() and torch.isinf(logits[1]).any()
    for seq in (3, 4):
        matchers.release(seq)


def test_enforce_after_is_not_part_of_the_grammar_key() -> None:
    assert StructuredOutputs(regex="a", enforce_after=(1, 2)).key == StructuredOutputs(regex="a").key
