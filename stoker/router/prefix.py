"""Which replica has already seen a prompt's prefix: an approximate prefix index. [no torch]

Why a chain of chunk hashes rather than SGLang's character radix tree or a consistent hash of
the first N characters:
- A consistent hash on a fixed first-N window sends every request that shares those N
  characters (one long system prompt) to one replica, whatever follows, and cannot say how
  much of a prompt a replica has seen, which conditional disaggregation needs (the uncached
  part of a prompt is what a prefill costs).
- A radix tree answers "longest shared prefix per replica" exactly, but costs a node walk per
  character and per-node tenant maps in Python.
- The engine's own prefix cache keys KV blocks by a chained hash of fixed-size token blocks
  (docs/engine.md, prefix caching); the index here does the same on characters: the prompt is
  cut into `chunk_chars` pieces and chunk i is keyed by hash(key of chunk i-1, chunk i), so a
  key matches only when the whole prefix up to it matches. Matching is one dict lookup per
  chunk (a 4,000-character prompt with 64-character chunks: 63 lookups), the answer has
  chunk resolution, and entries are evicted least recently used once `max_entries` is reached.
Characters stand in for tokens: the router does not tokenize on the balancing path, and two
prompts that share k characters share about k/4 tokens of KV on any replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PrefixIndex:
    def __init__(self, chunk_chars: int = 64, max_entries: int = 200_000) -> None:
        if chunk_chars < 1 or max_entries < 1:
            raise ValueError("chunk_chars and max_entries must be positive")
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        # chained chunk key -> the replicas that served a prompt with this prefix (insertion-ordered
        # dict used as an ordered set); the OrderedDict order is recency, oldest first.
        self._entries: OrderedDict[int, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _keys(self, text: str) -> list[int]:
        """Chained keys of the whole chunks of `text` (a tail shorter than a chunk is not
        indexed, as the engine caches only full blocks)."""
        keys: list[int] = []
        prev = 0
        c = self.chunk_chars
        for start in range(0, len(text) - c + 1, c):
            prev = hash((prev, text[start:start + c]))
            keys.append(prev)
        return keys

    def match(self, text: str, replicas: Iterable[str]) -> dict[str, int]:
        """Characters of `text`'s prefix each replica has seen (a multiple of chunk_chars; 0 if none)."""
        matched = {r: 0 for r in replicas}
        alive = set(matched)
        for depth, key in enumerate(self._keys(text), start=1):
            owners = self._entries.get(key)
            if owners is None:
                break
            alive &= owners.keys()
            if not alive:
                break
            for r in alive:
                matched[r] = depth * self.chunk_chars
        return matched

    def insert(self, text: str, replica: str) -> None:
        """Record that `replica` now holds `text`'s prefix (it is about to prefill it). Deepest
        chunk first, so a prefix's shorter keys are always more recent than its longer ones and
        eviction trims chains from the end, never leaving a tail behind a missing head."""
        for key in reversed(self._keys(text)):
            owners = self._entries.get(key)
            if owners is None:
                owners = self._entries[key] = {}
            else:
                self._entries.move_to_end(key)
            owners[replica] = None
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop a replica from every entry (it restarted or died: its prefix cache is gone)."""
        empty = []
        for key, owners in self._entries.items():
            owners.pop(replica, None)
            if not owners:
                empty.append(key)
        for key in empty:
            del self._entries[key]
