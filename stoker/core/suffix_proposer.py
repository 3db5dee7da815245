"""SuffixDecoding drafts: the sequence's own occurrences and a suffix tree of recent outputs. [no torch]

Two sources answer every proposal (Oliaro et al., 2024, arXiv 2411.04975; vLLM's `suffix` method):
* the sequence itself, its prompt and the tokens it generated so far (what n-gram lookup sees,
  but frequency-weighted: the continuation that followed the context most often, not the most
  recent one);
* a shared suffix tree (core/suffix_tree.py) over the outputs of the last `max_cached_requests`
  finished sequences, oldest evicted first (agents, self-refinement and templated answers
  repeat earlier responses).
The context is the sequence's last `max_tree_depth` tokens. Each source drafts, for each suffix
of the context it holds (m tokens), the most frequent continuation, at most
min(k, max_spec_factor * m, max_tree_depth - m) tokens, cut where the estimated probability (the
product of the frequencies along the path) falls below `min_token_prob`; the draft with the
highest score (sum of the probabilities) is proposed.

The sequence's own counts are those of a suffix tree of depth max_tree_depth over it (the
occurrence at its end counted, as it would be in the tree) but found by scanning the positions
holding its last token (`list.index`, a C scan) once per step, as the n-gram proposer does:
a tree per running sequence would cost memory for every prompt token, a scan costs nothing
between steps.
"""

from __future__ import annotations

from collections import OrderedDict

from stoker.core.sequence import Sequence
from stoker.core.suffix_tree import Draft, SuffixTree


def speculate_in_sequence(tokens: list[int], max_depth: int, max_tokens: int, max_spec_factor: float,
                          min_token_prob: float) -> Draft:
    """The best draft to follow `tokens` from its own earlier occurrences (see the module doc)."""
    n = len(tokens)
    if n < 2 or max_tokens <= 0:
        return Draft([], [], 0)
    last = tokens[-1]
    # Earlier positions j holding the last token and the length of the match ending there
    # (at most max_depth - 1: a window holds the match and at least one token after it).
    matches: list[tuple[int, int]] = []
    j = -1
    try:
        while True:
            j = tokens.index(last, j + 1, n - 1)
            m, limit = 1, min(max_depth - 1, j + 1)
            while m < limit and tokens[j - m] == tokens[n - 1 - m]:
                m += 1
            matches.append((j, m))
    except ValueError:
        pass
    best = Draft([], [], 0)
    longest = max((m for _, m in matches), default=0)
    for m in range(1, longest + 1):
        ends = [j for j, mj in matches if mj >= m]  # occurrences of the context's last m tokens
        limit = min(max_tokens, int(m * max_spec_factor + 1e-9), max_depth - m)
        draft_tokens: list[int] = []
        probs: list[float] = []
        prob, node_count = 1.0, len(ends) + 1  # + the occurrence at the sequence's end
        while len(draft_tokens) < limit:
            i = len(draft_tokens)
            counts: dict[int, int] = {}
            for e in ends:  # in order of position: among equal counts the earliest continuation
                if e + 1 + i < n:
                    t = tokens[e + 1 + i]
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            token, c = max(counts.items(), key=lambda kv: kv[1])
            prob *= c / node_count
            if prob < min_token_prob:
                break
            draft_tokens.append(token)
            probs.append(prob)
            ends = [e for e in ends if e + 1 + i < n and tokens[e + 1 + i] == token]
            node_count = len(ends)
        draft = Draft(draft_tokens, probs, m)
        if draft_tokens and draft.score >= best.score:
            best = draft
    return best


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        assert num_speculative_tokens >= 1 and max_tree_depth >= 1 and max_cached_requests >= 0
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests  # 0: no shared tree, each sequence's own tokens only
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # seq_id -> output tokens, oldest first

    def propose_tokens(self, token_ids: list[int], max_tokens: int | None = None, shared: bool = True) -> Draft:
        """The draft to follow `token_ids` (prompt + output so far): its tokens and their estimated
        probabilities; at most min(num_speculative_tokens, max_tokens) tokens. `shared` False: from
        the sequence alone."""
        k = self.num_speculative_tokens if max_tokens is None else min(self.num_speculative_tokens, max_tokens)
        if k <= 0 or not token_ids:
            return Draft([], [], 0)
        best = speculate_in_sequence(token_ids, self.max_tree_depth, k, self.max_spec_factor, self.min_token_prob)
        if shared and self._cached:
            context = token_ids[-self.max_tree_depth :]
            other = self.global_tree.speculate(context, k, self.max_spec_factor, self.min_token_prob)
            if other.score > best.score:
                best = other
        return best

    def propose_for(self, seq: Sequence, max_tokens: int) -> list[int]:
        # A seeded sampled request drafts from itself alone: the rejection sampler draws from the
        # request's generator once per verified draft, so drafts that depended on what other
        # requests produced earlier would make the same seed give a different output
        seeded = seq.sampling_params.seed is not None and seq.sampling_params.temperature > 0
        return self.propose_tokens(seq.token_ids, max_tokens, shared=not seeded).token_ids

    def on_finished(self, seq: Sequence) -> None:
        """The sequence is done: its output joins the shared tree."""
        self.finish(seq.seq_id, seq.output_token_ids)

    def finish(self, key: int, output: list[int]) -> None:
        """Cache a finished output under `key` (once), evicting the oldest beyond max_cached_requests."""
        if self.max_cached_requests == 0 or not output or key in self._cached:
            return
        tokens = list(output)  # the tree's tails point into it: a copy nobody changes
        self.global_tree.add(tokens)
        self._cached[key] = tokens
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popitem(last=False)
            self.global_tree.remove(old)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)
