"""Choosing a replica within a pool: cache-aware unless the pool is out of balance. [no torch]

The rule is SGLang's cache-aware router's, with its knobs' names and defaults
(`--cache-threshold` 0.3, `--balance-abs-threshold` 64, `--balance-rel-threshold` 1.5), and
the load measured as the servers report it rather than as the router counts it alone:
1. Out of balance (the busiest replica has more than `balance_abs_threshold` requests over
   the idlest and more than `balance_rel_threshold` times as many): the least loaded.
2. Otherwise the replica that has seen the longest prefix of this prompt, if that prefix is at
   least `cache_threshold` of the prompt: its prefix cache saves that much prefill.
3. Otherwise the least loaded; ties go to the lower KV usage, then to the replica sent the
   fewest requests so far (idle replicas take turns).
`round_robin` and `least_load` skip the prefix step (for comparisons and for prompts that share
nothing).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from stoker.router.prefix import PrefixIndex
from stoker.router.upstream import Upstream

POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True)
class Choice:
    upstream: Upstream
    matched_chars: int  # prefix of the prompt this replica has seen (approximate, chunk resolution)
    prompt_chars: int

    @property
    def cached_fraction(self) -> float:
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0


class Pool:
    """The replicas of one role and the prefix index over them."""

    def __init__(self, upstreams: list[Upstream], policy: str = "cache_aware", cache_threshold: float = 0.3,
                 balance_abs_threshold: float = 64, balance_rel_threshold: float = 1.5,
                 prefix_chunk_chars: int = 64) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.upstreams = upstreams
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(prefix_chunk_chars)
        self._turn = itertools.count()

    def healthy(self, exclude: frozenset[str] = frozenset()) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy and u.url not in exclude]

    def choose(self, text: str, exclude: frozenset[str] = frozenset()) -> Choice | None:
        """The replica for a prompt whose prefix-bearing text is `text`; None if none is healthy.
        Records the prompt under the chosen replica (it will hold that prefix's KV)."""
        candidates = self.healthy(exclude)
        if not candidates:
            return None
        if self.policy == "round_robin":
            up = candidates[next(self._turn) % len(candidates)]
            return self._commit(up, text, 0)
        idlest = min(candidates, key=lambda u: (u.load, u.kv_usage, u.assigned))
        if self.policy == "least_load" or len(candidates) == 1:
            return self._commit(idlest, text, self.index.match(text, [idlest.url])[idlest.url] if text else 0)
        matched = self.index.match(text, [u.url for u in candidates]) if text else {}
        busiest = max(u.load for u in candidates)
        imbalanced = (busiest - idlest.load > self.balance_abs_threshold
                      and busiest > self.balance_rel_threshold * idlest.load)
        if not imbalanced and text:
            best = max(candidates, key=lambda u: (matched[u.url], -u.load, -u.kv_usage, -u.assigned))
            if matched[best.url] >= self.cache_threshold * len(text) and matched[best.url] > 0:
                return self._commit(best, text, matched[best.url])
        return self._commit(idlest, text, matched.get(idlest.url, 0))

    def _commit(self, up: Upstream, text: str, matched: int) -> Choice:
        up.assigned += 1
        if text and self.policy != "round_robin":
            self.index.insert(text, up.url)
        return Choice(up, matched, len(text))
