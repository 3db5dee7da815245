"""Compiled grammars (cached by spec) and the per-sequence matchers that mask each step's logits.

`GrammarCache.compile(spec)` is safe to call from any thread: the server calls it in a worker
thread before admitting a request, so the step loop only finds compiled grammars (a schema
compiles in well under a millisecond to tens of milliseconds). The JSON grammars are compact
(no free whitespace between tokens: `any_whitespace=False`), as vLLM does with
`disable-any-whitespace`: a model may not pad its output with whitespace forever.

JSON strings never hold a raw control character (U+0000-U+001F; JSON requires them escaped).
xgrammar's rule for a length-bounded string (`maxLength` / `minLength`) is `[^"\\\r\n]{m,n}`,
which admits them (an open upstream bug vLLM shares: a random model once wrote \x08 inside a
tool argument, and a strict client's parser refused the whole reply). So a schema's grammar is
taken as EBNF, that character class is narrowed to the one xgrammar's own unbounded strings use
(`[^\0-\x1f"\\\r\n]`), and the patched grammar is compiled (`_json_grammar`).

`GrammarMatchers` lives beside the sampler on the rank that samples: one xgrammar matcher per
sequence, created on the sequence's first sampling step (a preempted sequence keeps its
matcher: the tokens it accepted are still its output), advanced by the sampled token, dropped
when the sequence is released. Its mask is applied to the rows that carry a grammar only
(bitmask (S, ceil(V / 32)) int32), so constrained and free rows share one step.

A spec with `enforce_after` (a reasoning end marker's token ids) gets no matcher until the
sequence's sampled tokens hold that sequence: until then its row is left free (a `_Gate` follows
the accepted tokens), and the grammar starts with the token after the marker. Specs without it
never touch the gates.

Speculative decoding (`mask_drafts`): a sequence verifying drafts d_0..d_{k-1} samples k + 1
rows; row j must see the grammar's state after the output and d_0..d_{j-1}, as decoding without
drafts would. The matcher walks the drafts, filling row j before accepting d_j, and stops at the
first draft the grammar refuses: that draft's own row forbids it, so verification rejects it
(greedy: it is not the masked argmax; sampled: its probability is 0) and the rows after it are
never kept (left unmasked). The walk is then rolled back (`GrammarMatcher.rollback`): only the
tokens verification kept advance the matcher (`accept_tokens`), so a rejected draft never
touches the grammar's state. `allowed_prefix` is the same walk without masks: how many of a
draft model's proposals the grammar allows (the rest would only be rejected).
"""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import torch

from stoker.structured.spec import StructuredOutputs


class GrammarCache:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self.xgr = xgr  # the module, for the matchers
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar; ValueError (naming what is wrong) for a spec xgrammar refuses."""
        with self._lock:
            hit = self._compiled.get(spec.key)
        if hit is not None:
            return hit
        try:
            if spec.kind == "json":
                compiled = self._compiler.compile_grammar(self._json_grammar(spec.json or "", strict_mode=True))
            elif spec.kind == "json_object":
                compiled = self._compiler.compile_grammar(self._json_grammar(json.dumps({"type": "object"})))
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.regex)
            elif spec.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in spec.choice or ())
                compiled = self._compiler.compile_grammar(f"root ::= {alternatives}")
            else:
                compiled = self._compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"the {spec.kind} constraint cannot be enforced: {first}") from None
        with self._lock:
            self._compiled[spec.key] = compiled
        return compiled

    def _json_grammar(self, schema: str, strict_mode: bool = False) -> Any:
        """The schema's grammar with no raw control character allowed in any string (see above)."""
        ebnf = str(self.xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
        return self.xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


# One character of a JSON string as xgrammar 0.2 writes it in EBNF: its bounded-length rule, and
# its unbounded rule (which excludes U+0000-U+001F, as JSON requires).
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


class _Gate:
    """Whether a token sequence (the marker) has appeared yet in the tokens fed one by one."""

    __slots__ = ("marker", "recent", "open")

    def __init__(self, marker: tuple[int, ...]) -> None:
        self.marker = marker
        self.recent: tuple[int, ...] = ()  # the last len(marker) - 1 tokens at most
        self.open = False

    def feed(self, token: int) -> None:
        window = (*self.recent, token)[-len(self.marker):]
        if window == self.marker:
            self.open = True
        self.recent = window[1:] if len(window) == len(self.marker) else window


class GrammarMatchers:
    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self.matchers: dict[int, Any] = {}
        self.gates: dict[int, _Gate] = {}  # sequences whose grammar waits for its enforce_after marker

    def _waiting(self, seq_id: int, spec: StructuredOutputs) -> bool:
        """True while the sequence's grammar is not enforced yet (its marker not yet sampled)."""
        if seq_id in self.matchers:
            return False
        gate = self.gates.get(seq_id)
        if gate is None:
            gate = self.gates[seq_id] = _Gate(spec.enforce_after)
        return not gate.open

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, int, StructuredOutputs]]) -> None:
        """Mask `logits` (S, V) in place for the (row, seq_id, spec) rows that carry a grammar."""
        if any(spec.enforce_after for _, _, spec in rows):
            rows = [r for r in rows if not (r[2].enforce_after and self._waiting(r[1], r[2]))]
            if not rows:
                return
        xgr = self.cache.xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.cache.info.vocab_size)
        for row, seq_id, spec in rows:
            self.matcher_for(seq_id, spec).fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[r for r, _, _ in rows])

    def mask_drafts(self, logits: torch.Tensor, groups: list[tuple[int, int, StructuredOutputs, tuple[int, ...]]]) -> None:
        """Verification: mask `logits` (N, V) in place for the (first row, seq_id, spec, drafts)
        groups that carry a grammar; a group owns rows first row .. first row + len(drafts)."""
        xgr = self.cache.xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.cache.info.vocab_size)  # (N, ceil(V / 32))
        masked: list[int] = []
        for first_row, seq_id, spec, drafts in groups:
            matcher, start = self._judge(seq_id, spec, drafts)
            if matcher is not None:
                self._walk(matcher, drafts, start, bitmask, first_row, masked)
        if masked:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=masked)

    def allowed_prefix(self, seq_id: int, spec: StructuredOutputs, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar allows from the sequence's state (unchanged)."""
        matcher, start = self._judge(seq_id, spec, drafts)
        return len(drafts) if matcher is None else self._walk(matcher, drafts, start, None, 0, [])

    def _judge(self, seq_id: int, spec: StructuredOutputs, drafts: tuple[int, ...] | list[int]) -> tuple[Any, int]:
        """The matcher that judges drafts[start:] and start: the sequence's own (made on first
        use, as `mask` makes it); for a sequence whose marker is not out yet, a scratch matcher
        from the draft after the one that completes the marker; (None, len) if none does."""
        if seq_id in self.matchers or not spec.enforce_after or not self._waiting(seq_id, spec):
            return self.matcher_for(seq_id, spec), 0
        gate = copy.copy(self.gates[seq_id])  # the drafts may complete the marker; only kept tokens open the real gate
        for j, token in enumerate(drafts):
            gate.feed(token)
            if gate.open:
                return self.cache.xgr.GrammarMatcher(self.cache.compile(spec)), j + 1
        return None, len(drafts)

    @staticmethod
    def _walk(matcher: Any, drafts: tuple[int, ...] | list[int], start: int, bitmask: torch.Tensor | None,
              first_row: int, masked: list[int]) -> int:
        """Fill row first_row + j (when `bitmask` is given) for j = start .. len(drafts), accepting
        d_j after its row, up to the first draft refused or a stop token accepted; roll the
        matcher back to where it was. -> how many leading drafts passed."""
        advanced = 0
        for j in range(start, len(drafts) + 1):
            if matcher.is_terminated():  # a drafted stop token ended the grammar: the output ends there
                break
            if bitmask is not None:
                matcher.fill_next_token_bitmask(bitmask, first_row + j)
                masked.append(first_row + j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
        return start + advanced

    def matcher_for(self, seq_id: int, spec: StructuredOutputs) -> Any:
        """The sequence's matcher, made on first use (its grammar applies from now on)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            matcher = self.matchers[seq_id] = self.cache.xgr.GrammarMatcher(self.cache.compile(spec))
            self.gates.pop(seq_id, None)
        return matcher

    def accept_tokens(self, seq_id: int, spec: StructuredOutputs, tokens: list[int]) -> None:
        """A verified run: the grammar starts at the token after the marker even mid-run."""
        for token in tokens:
            if seq_id not in self.matchers and not (spec.enforce_after and self._waiting(seq_id, spec)):
                self.matcher_for(seq_id, spec)
            self.accept(seq_id, token)

    def accept(self, seq_id: int, token: int) -> None:
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            gate = self.gates.get(seq_id)
            if gate is not None:
                gate.feed(token)  # the marker's last token opens it: the grammar starts with the next one
            return
        if not matcher.is_terminated() and not matcher.accept_token(token):
            raise RuntimeError(f"sequence {seq_id}: the grammar rejected token {token}, which its own mask allowed")

    def release(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self.gates.pop(seq_id, None)
