"""What the engine asks a draft proposer for, and which proposer a configuration makes. [no torch]

A proposer drafts the next tokens of a sequence before each step (the engine then verifies them
in one forward: sampling/rejection.py) and hears when a sequence finishes (a proposer that keeps
state per sequence frees it; one that learns from finished outputs takes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from stoker.config import SpeculativeConfig
    from stoker.core.sequence import Sequence


class Proposer(Protocol):
    num_speculative_tokens: int  # the most tokens one proposal holds (k)

    def propose_for(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens to follow the sequence; [] for none."""
        ...

    def on_finished(self, seq: Sequence) -> None:
        """The sequence finished (stopped, aborted): whatever was kept for it goes."""
        ...


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    """The host-side proposer of a method that drafts without a model (ngram, suffix)."""
    if spec.method == "suffix":
        from stoker.core.suffix_proposer import SuffixProposer

        return SuffixProposer(spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
                              spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
                              spec.suffix_decoding_min_token_prob)
    from stoker.core.ngram_proposer import NgramProposer

    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
