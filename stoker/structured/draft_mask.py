"""A draft model's proposals masked by the sequences' grammars, so it drafts what could be kept.

The target's masks alone keep the output valid (structured/grammar.py, `mask_drafts`); a draft
model that ignores the grammar mostly proposes tokens the grammar refuses, and those are cut
before verification (`allowed_prefix`), leaving few drafts. Masking the draft's own logits
with the same grammar lets it propose the best token the grammar allows at every position (a
model drafting for itself then proposes exactly the target's masked argmax).

One `DraftMask` lives for one proposal loop (spec_decode/drafter.py): each draft forward's
sampling rows are masked from the state after the sequence's kept tokens and the drafts
proposed so far; each proposed token advances the sequence's matcher, and `close` rolls every
matcher back, so the proposals never touch the grammar's state. A sequence whose grammar waits
for its reasoning marker, or has ended (a drafted stop token), drafts unmasked.
"""

from __future__ import annotations

import torch

from stoker.structured.grammar import GrammarMatchers
from stoker.structured.spec import StructuredOutputs


class DraftMask:
    def __init__(self, matchers: GrammarMatchers, grammars: dict[int, StructuredOutputs]) -> None:
        self.matchers = matchers
        self.grammars = grammars  # seq_id -> its grammar, for the sequences that carry one
        self.advanced: dict[int, int] = {}  # seq_id -> drafts its matcher accepted (rolled back on close)
        self.unmasked: set[int] = set()  # sequences whose matcher refused a draft: the rest is cut anyway

    def _live(self, seq_id: int):
        """The sequence's matcher if its grammar applies to the next draft, else None."""
        spec = self.grammars.get(seq_id)
        if spec is None or seq_id in self.unmasked or (spec.enforce_after and seq_id not in self.matchers.matchers):
            return None
        matcher = self.matchers.matcher_for(seq_id, spec)
        return None if matcher.is_terminated() else matcher

    def argmax(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """(S, V) draft logits of `seq_ids`' sampling rows -> (S,) greedy drafts, each the most
        likely token its grammar allows; every matcher advanced by its row's draft."""
        live = [(row, m) for row, seq_id in enumerate(seq_ids) if (m := self._live(seq_id)) is not None]
        if live:
            xgr = self.matchers.cache.xgr
            bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.matchers.cache.info.vocab_size)
            for row, matcher in live:
                matcher.fill_next_token_bitmask(bitmask, row)
            logits = logits.clone()  # (S, V): the draft model's own tensor stays as it was
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[row for row, _ in live])
        tokens = logits.argmax(dim=-1)
        if live:
            host = tokens.tolist()
            for row, matcher in live:
                seq_id = seq_ids[row]
                if matcher.accept_token(host[row]):
                    self.advanced[seq_id] = self.advanced.get(seq_id, 0) + 1
                else:  # a token past the grammar's vocabulary: `allowed_prefix` cuts the draft here
                    self.unmasked.add(seq_id)
        return tokens

    def close(self) -> None:
        for seq_id, n in self.advanced.items():
            self.matchers.matchers[seq_id].rollback(n)
        self.advanced.clear()
        self.unmasked.clear()
