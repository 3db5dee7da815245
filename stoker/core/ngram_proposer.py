"""N-gram (prompt lookup) drafts for speculative decoding. [no torch]

The sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are
looked up earlier in the same sequence (its prompt and what it generated so far); the tokens
that followed the match are proposed as the next ones. Code edits, summaries, extraction and
chat over a document repeat their input, so the continuation of an earlier occurrence is often
the continuation now (Saxena, "Prompt Lookup Decoding", 2023; vLLM's `ngram` method).

Among the matches of the longest n, the most recent is taken: in a loop or an edited file the
latest occurrence is the one the text is following now. When fewer than k tokens follow it (the
match overlaps the suffix: a loop shorter than k), the copy runs on into the tokens it has just
proposed, so a loop of period p is proposed k tokens deep, not p - 1. Proposing costs one pass over the
sequence in C (`list.index`) for the positions holding the last token, then a short Python walk
per such position (at most prompt_lookup_max comparisons each), once per decode step per sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoker.core.sequence import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max and num_speculative_tokens >= 1
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens to follow `token_ids` (the
        sequence so far); [] when no suffix of at least prompt_lookup_min tokens recurs."""
        k = self.num_speculative_tokens if max_tokens is None else min(self.num_speculative_tokens, max_tokens)
        num = len(token_ids)
        if k <= 0 or num < self.prompt_lookup_min + 1:
            return []
        last = token_ids[-1]
        longest = self.prompt_lookup_max
        best_len, best_end = 0, -1
        # Candidate ends: earlier positions j <= num - 2 holding the last token (so a token follows
        # each), found by list.index (a C scan) and walked latest first.
        ends: list[int] = []
        j = -1
        try:
            while True:
                j = token_ids.index(last, j + 1, num - 1)
                ends.append(j)
        except ValueError:
            pass
        for j in reversed(ends):
            m = 1
            limit = min(longest, j + 1)
            while m < limit and token_ids[j - m] == token_ids[num - 1 - m]:
                m += 1
            if m > best_len:  # strictly longer: among equals the latest (found first) stays
                best_len, best_end = m, j
                if m == longest:
                    break
        if best_len < self.prompt_lookup_min:
            return []
        # What followed the match, copied as LZ77 copies: a match close to the end (a short loop,
        # "a b a b") runs into the proposal itself, which continues the same period to k tokens.
        out: list[int] = []
        for i in range(best_end + 1, best_end + 1 + k):
            out.append(token_ids[i] if i < num else out[i - num])
        return out

    # The engine's proposer interface (core/proposer.py): n-gram lookup keeps nothing per sequence.
    def propose_for(self, seq: Sequence, max_tokens: int) -> list[int]:
        return self.propose(seq.token_ids, max_tokens)

    def on_finished(self, seq: Sequence) -> None:
        pass
