"""k chosen by the wall: how many drafted tokens per sequence a step verifies. [no torch]

Verifying d drafts costs a sequence d more tokens of the forward; it saves the steps its
accepted drafts replace. Where a step is bound by reading weights (small batches) the extra
tokens ride along almost free; where it is compute-bound every verified token costs what a
decoded one does, and a draft that is rejected is pure loss (the slowdown every serving stack
reports for speculation at high load). So per step, for every cap k on the drafts (0 .. the
longest proposal), the policy prices the step the scheduler is about to run with the cost model
(`price(StepShape) -> seconds`, roofline/live.py's model of this model on this device) and
counts the tokens it expects to emit, and keeps the k with the most tokens per second (ties: the
smaller k), provided it beats drafting nothing by MIN_GAIN: the roofline prices a
weight-read-bound step's extra tokens at nearly nothing, but each verified row still costs its
attention, its LM head row and its sampling (on a 2-core CPU drafts that all failed made batch-1
decode ~15% slower), so a predicted gain of a few percent (drafts almost never accepted) is
within the model's error and not worth verifying.

With a draft model or an EAGLE-3 head (the runner drafts, spec_decode/drafter.py) the drafts
are not free: each proposal round is one forward of the draft over the batch, priced with the
same roofline (`draft_price`, the draft's own weights and FLOPs, a decode-shaped step of the
batch on it), so a cap k costs the verification plus k draft rounds, and k = 0, when chosen,
runs no draft forward at all (the draft catches up later, in one forward). The cap is then
chosen before the proposals exist (the runner makes them after this step's sampling): every
decoding sequence is planned as proposing what it may (k, within its max_tokens and
max_model_len), and the choice reaches the runner in the step message.

Expected tokens: a decode emits 1; a sequence verifying d drafts emits 1 + sum_{j<d} P(drafts
0..j all accepted). The per-position conditional acceptance a_i = P(draft i accepted | drafts
0..i-1 were) is learned from the verifications, exponentially forgetting (a half-life of
`HALF_LIFE` verifications, so a change of workload shows within a few hundred steps), starting
from a prior of PRIOR_ACCEPTANCE worth PRIOR_WEIGHT verifications so the first steps do draft;
a step that proposed but drafts nothing ages the estimate too, so a low acceptance learned once
is tried again after a few half-lives.
Pricing every cap costs ~0.1 ms per cap in Python, so a decision serves the next REUSE_STEPS
steps of the same batch size and proposal length (contexts and acceptance move slowly).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stoker.core.step import StepShape

HALF_LIFE = 500.0  # verifications
PRIOR_ACCEPTANCE = 0.5  # before any verification: even odds for each position
PRIOR_WEIGHT = 2.0  # ... worth two verifications
REUSE_STEPS = 7  # a decision serves the next steps of the same batch size and proposal length
MIN_GAIN = 0.05  # drafting must promise this much more tokens/s than k = 0


@dataclass(frozen=True)
class PlannedSeq:
    """A sequence about to decode: its tokens so far (the last one uncomputed) and its proposal length."""

    num_tokens: int
    num_drafts: int


class SpecKPolicy:
    def __init__(self, max_k: int, price: Callable[[StepShape], float] | None,
                 draft_price: Callable[[StepShape], float] | None = None) -> None:
        """`price`: predicted seconds of a step's shape; None: no cost model, k stays max_k.
        `draft_price`: predicted seconds of one draft forward of a step's shape (a draft model or
        an EAGLE-3 head); None: drafts cost nothing (n-gram, suffix)."""
        assert max_k >= 1
        self.max_k = max_k
        self.price = price
        self.draft_price = draft_price
        self._reached = [0.0] * max_k  # verifications that drafted position i with 0..i-1 accepted (decayed)
        self._accepted = [0.0] * max_k  # ... and accepted it
        self._decay = 0.5 ** (1.0 / HALF_LIFE)
        self.last_k: int | None = None  # the cap of the last step that had proposals
        self.steps_at_k: Counter[int] = Counter()  # steps (with proposals) per chosen k
        self._memo: tuple[tuple[int, int, bool], int, int] | None = None  # (batch key, k, steps it may still serve)

    # ------------------------------------------------------------------ learning
    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verification: `num_accepted` of its `num_draft_tokens` drafts kept."""
        if num_draft_tokens <= 0:
            return
        self._forget()
        # Position i is reached when drafted and every draft before it was accepted: i <= num_accepted
        for i in range(min(num_accepted + 1, num_draft_tokens)):
            self._reached[i] += 1.0
            if i < num_accepted:
                self._accepted[i] += 1.0

    def _forget(self) -> None:
        """One half-life step toward the prior (what is learned fades as it ages)."""
        d = self._decay
        for i in range(self.max_k):
            self._reached[i] *= d
            self._accepted[i] *= d

    def acceptance(self) -> list[float]:
        """a_i, the conditional acceptance of draft position i."""
        return [(a + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT) for a, r in zip(self._accepted, self._reached)]

    def expected_accepted(self, d: int, acceptance: list[float] | None = None) -> float:
        """Drafts a sequence verifying d of them is expected to keep."""
        acc = acceptance or self.acceptance()
        total, run = 0.0, 1.0
        for i in range(min(d, self.max_k)):
            run *= acc[i]
            total += run
        return total

    # ------------------------------------------------------------------ deciding
    def choose(self, seqs: Sequence[PlannedSeq], prefill_tokens: int = 0, prefill_attended: int = 0) -> int:
        """The cap on drafts per sequence for the next step: `seqs` are the sequences about to decode
        with their proposals; the step also computes `prefill_tokens` prompt tokens attending
        `prefill_attended` positions in all (the scheduler's chunks beside them)."""
        longest = min(max((s.num_drafts for s in seqs), default=0), self.max_k)
        if longest == 0:
            return 0
        key = (len(seqs), longest, prefill_tokens > 0)
        if self.price is None:
            k = longest
        elif self._memo is not None and self._memo[0] == key and self._memo[2] > 0:
            # The same batch size and proposal length as a recent step: its k (pricing every cap
            # costs ~0.1 ms per cap in Python; contexts and acceptance move slowly between steps)
            k = self._memo[1]
            self._memo = (key, k, self._memo[2] - 1)
        else:
            acc = self.acceptance()
            expected = [self.expected_accepted(d, acc) for d in range(longest + 1)]
            best_rate, k, rate_none = -1.0, 0, 0.0
            draft_round = self.draft_price(self.draft_shape(seqs)) if self.draft_price is not None else 0.0
            for cap in range(longest + 1):
                tokens = sum(1.0 + expected[min(s.num_drafts, cap)] for s in seqs)
                seconds = self.price(self.shape(seqs, cap, prefill_tokens, prefill_attended)) + cap * draft_round
                rate = tokens / seconds if seconds > 0 else 0.0
                if cap == 0:
                    rate_none = rate
                if rate > best_rate * (1 + 1e-9):  # strictly better: among equals the smaller k
                    best_rate, k = rate, cap
            if best_rate < rate_none * (1 + MIN_GAIN):  # a gain within the model's error: no drafts
                k = 0
            self._memo = (key, k, REUSE_STEPS)
        if k == 0 and self.price is not None:
            # Nothing is verified, so nothing is learned: a step that proposed yet drafts nothing
            # ages the estimate as a verification would, so an acceptance learned low drifts back
            # toward the prior and drafting is tried again (a workload that changed is noticed)
            self._forget()
        self.last_k = k
        self.steps_at_k[k] += 1
        return k

    @staticmethod
    def draft_shape(seqs: Sequence[PlannedSeq]) -> StepShape:
        """One proposal round of the draft: a decode of every proposing sequence, reading its
        context in the draft's cache (the first round also catches up the accepted tokens, a few
        rows more of the same weight read)."""
        proposing = [s for s in seqs if s.num_drafts > 0]
        return StepShape(0, 0, len(proposing), sum(s.num_tokens for s in proposing), len(proposing), 0, 0)

    @staticmethod
    def shape(seqs: Sequence[PlannedSeq], cap: int, prefill_tokens: int = 0, prefill_attended: int = 0) -> StepShape:
        """The step's shape with every proposal cut to `cap`, as `StepMessage.shape` will count it: a
        sequence verifying d drafts reads its whole cached context once, as a decode does, and
        computes 1 + d tokens: a decode (its KV read) plus d draft tokens attending that context
        (their FLOPs). (Priced as a prefill chunk, the cost model would count the d + 1 tokens'
        K/V written but not the context read, and a verify step would look cheaper than the
        decode it replaces.)"""
        context, extra, draft_attended, sampled = 0, 0, 0, 0
        for s in seqs:
            d = min(s.num_drafts, cap)
            sampled += 1 + d
            context += s.num_tokens
            extra += d
            draft_attended += d * s.num_tokens + d * (d + 1) // 2
        return StepShape(prefill_tokens, prefill_attended, len(seqs), context,
                         sampled + (1 if prefill_tokens else 0), extra, draft_attended)
