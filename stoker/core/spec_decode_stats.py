"""Speculative-decoding counters, as vLLM's `vllm:spec_decode_*` metrics count them. [no torch]

Per step, each sequence that verified drafts adds one draft, its draft tokens, the drafts the
rejection sampler accepted (its emitted tokens but the last, which is new), and one per accepted
position: position i counts when drafts 0..i were all accepted, so the per-position counts fall
with i and their sum is the accepted total. Mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # drafts proposed per sequence per step at most (num_speculative_tokens)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verification: `num_accepted` of its `num_draft_tokens` drafts kept."""
        assert 0 <= num_accepted <= num_draft_tokens <= self.num_spec_tokens, (num_accepted, num_draft_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying sequence keeps per step: its accepted drafts and the new token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))
