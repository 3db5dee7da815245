"""Drafting in the runner, right after the target sampled (vLLM V1's place for it).

Per step, for every scheduled sequence the draft first catches up: it computes the positions the
target computed and kept this step (known tokens, accepted drafts), so its KV cache stays in
lockstep with the target's (spec_decode/draft_cache.py). A sequence that sampled then gets its
proposals: the catch-up's last row gives the first, and k - 1 one-token forwards the rest, each
the draft's argmax. A greedy proposal is a point mass (q one-hot), so the rejection sampler
(sampling/rejection.py) keeps the target's distribution exactly, as for n-gram drafts.

`Drafter` holds that loop; a method says what its catch-up rows are and how one forward turns
rows into tokens: `DraftModelDrafter` (a smaller checkpoint of the same vocabulary, method
"draft_model") here, `Eagle3Drafter` (spec_decode/eagle3.py) beside it.

Under tensor parallelism every rank runs the loop in lockstep: the draft is sharded over the
target's group (its forwards hold the same collectives; spec_decode/factory.py says why), and what
only rank 0 knows crosses over the CPU group twice per step: the tokens each sequence kept with
the number of proposals it wants (a rank that does not sample has neither the tokens nor the
sampling parameters), then each proposal round's tokens (the draft's LM head gathers its logits
to rank 0 alone). Rank 0's tokens are the ones every rank feeds, so the ranks' draft caches hold
the same positions.

How many proposals a step makes is the engine's choice (core/spec_k_policy.py prices the draft's
forwards beside the verification), carried in the message (`StepMessage.num_speculative_tokens`),
so every rank knows it without a broadcast. At 0 a draft model runs no forward at all: what the
target kept is written down instead (`Lag`, from the messages alone: a step's tokens, cut at the
next step's first position, which says how many drafts were accepted), and the first step that
drafts again catches the draft's cache up over those positions in the same forward (one
multi-token row per sequence: a prefill of the draft, cheaper than the per-step forwards it
replaces). EAGLE-3 cannot defer: its rows need the target's hidden states of the step that
computed them (spec_decode/eagle3.py says what it does instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from stoker.config import EngineConfig
from stoker.core.step import SampledTokens, SeqStep, StepMessage
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.forward_context import ForwardContext, set_forward_context
from stoker.runner.inputs import ModelInputs, prepare_inputs
from stoker.spec_decode.draft_cache import DraftKVCache

if TYPE_CHECKING:
    from stoker.structured.draft_mask import DraftMask


@dataclass
class Kept:
    """What one sequence kept this step, as rank 0 saw it: its accepted tokens (drafts and the
    token after them) and how many proposals it wants next."""

    token_ids: list[int]
    num_drafts: int


@dataclass
class Lag:
    """Tokens a sequence's target kept (or may keep: a step's drafts, until the next step's first
    position says how many were accepted) at positions [start_pos, start_pos + len) that its draft
    cache does not hold yet."""

    start_pos: int
    token_ids: list[int]

    def until(self, pos: int) -> list[int] | None:
        """The lag's tokens before `pos`, where the sequence's next row sits; None when they do not
        reach it (the sequence was recomputed from before the lag, after a preemption, or skipped
        positions a prefix-cache hit supplied): those positions are the draft's as they are, which
        can only make its drafts worse, never the output (the rejection sampler decides)."""
        keep = pos - self.start_pos
        return self.token_ids[:keep] if 0 < keep <= len(self.token_ids) else None


@dataclass
class DraftRows:
    """One sequence's catch-up: `token_ids` at positions [start_pos, start_pos + len)."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_drafts: int  # proposals wanted after the catch-up (0: it only keeps the cache in step)
    hidden: torch.Tensor | None = None  # (len, hidden) per-row inputs of a head (EAGLE-3)


class Drafter:
    """The catch-up and proposal loop over `run` (one draft forward, a method's own)."""

    target_graphs_ok = True  # whether the target's decode may replay CUDA graphs
    defers_catch_up = True  # at k = 0: no forward, the catch-up waits for the next step that drafts

    def __init__(self, config: EngineConfig, cache: DraftKVCache, max_model_len: int, device: torch.device,
                 tp: TensorParallelGroup | None = None) -> None:
        spec = config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.cache = cache
        self.block_size = config.cache_config.block_size
        self.max_model_len = max_model_len
        self.device = device
        self.draft_mask: DraftMask | None = None  # during a proposal for sequences with a grammar
        self.tp = tp or TensorParallelGroup.single()  # the target's group: the ranks that run this loop
        self.lags: dict[int, Lag] = {}  # seq_id -> positions its draft cache skipped (k was 0)
        # rows one draft forward computes at most, as the target's step (its activations were profiled
        # for that many): a catch-up over long lags goes on in the next steps
        self.max_rows = config.scheduler_config.token_budget(max_model_len)
        self.num_draft_forwards = 0  # draft forwards run (catch-ups and proposal rounds), for stats and tests

    # ---- what a method provides
    def catch_up_rows(self, step: StepMessage, inputs: ModelInputs, kept: dict[int, Kept]) -> list[DraftRows]:
        raise NotImplementedError

    def run(self, seqs: list[SeqStep], hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One draft forward -> ((S,) greedy tokens of the S sampling rows, in order, on rank 0 (None
        on a rank whose LM head shard gathered to rank 0); (S, hidden) the hidden input of each
        row's next step, on every rank, or None for a method that needs none)."""
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        self.lags.pop(seq_id, None)

    # ---- the loop
    def cap(self, step: StepMessage) -> int:
        """The most proposals a sequence gets after `step`: the k the engine chose, within the configured one."""
        return self.k if step.num_speculative_tokens is None else min(self.k, step.num_speculative_tokens)

    def with_lag(self, seq_id: int, token_ids: list[int], start_pos: int) -> tuple[list[int], int]:
        """A catch-up's tokens from `start_pos`, preceded by what the sequence's draft cache skipped
        (its lag, consumed) when the lag runs up to `start_pos`."""
        lag = self.lags.pop(seq_id, None)
        skipped = lag.until(start_pos) if lag is not None else None
        if skipped is None:
            return token_ids, start_pos
        return skipped + token_ids, lag.start_pos

    def within_budget(self, plans: list[DraftRows]) -> list[DraftRows]:
        """Catch-ups cut to `max_rows` in all: a sequence whose rows (a long lag) do not fit
        computes what fits and keeps the rest as its lag, proposing nothing this step (its proposal
        row is its last). Without lags the rows are the step's own: within the target's budget and
        one new token per sequence, never cut."""
        room = self.max_rows + len(plans)
        for p in plans:
            if len(p.token_ids) > room:
                fit = max(room, 0)
                self.lags[p.seq_id] = Lag(p.start_pos + fit, p.token_ids[fit:])
                p.token_ids, p.num_drafts = p.token_ids[:fit], 0
            room -= len(p.token_ids)
        return plans

    def defer(self, step: StepMessage) -> None:
        """k = 0: no forward; every sequence's tokens of the step join its lag (its drafts too: the
        next step's first position cuts the rejected ones). Every rank sees the same message."""
        for s in step.seqs:
            tokens, start = self.with_lag(s.seq_id, list(s.token_ids), s.start_pos)
            self.lags[s.seq_id] = Lag(start, tokens)

    def num_drafts(self, step: StepMessage, seq_id: int, accepted: list[int], new_pos: int) -> int:
        """Proposals worth making for a sequence whose newest token sits at `new_pos`: within
        max_model_len and max_tokens (the step keeps the drafts and one more), none after EOS.
        Rank 0 only: the other ranks' messages carry no sampling parameters."""
        spec = step.sampling.get(seq_id)
        if spec is None:
            return 0
        room = min(self.cap(step), self.max_model_len - new_pos - 2)
        params = spec.params
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - spec.num_output_tokens - len(accepted) - 1)
        if not params.ignore_eos and accepted[-1] in step.eos_token_ids:
            return 0
        return max(room, 0)

    def kept(self, step: StepMessage, sampled: dict[int, SampledTokens] | None) -> dict[int, Kept]:
        """Rank 0's `sampled` (None on the other ranks) -> seq_id -> Kept, on every rank (one
        broadcast over the CPU group at TP > 1)."""
        if not any(s.do_sample for s in step.seqs):  # every rank knows this from the message alone
            return {}
        kept = None
        if self.tp.is_first:  # `sampled` None here: the step's sampling failed, nothing is kept
            kept = {}
            for s in step.seqs if sampled is not None else ():
                if s.do_sample and s.seq_id in sampled:
                    accepted = sampled[s.seq_id].token_ids
                    # the newest token's position: the known tokens, then the accepted run
                    new_pos = s.start_pos + s.num_tokens - len(s.draft_token_ids) + len(accepted) - 1
                    kept[s.seq_id] = Kept(accepted, self.num_drafts(step, s.seq_id, accepted, new_pos))
        return self.tp.broadcast_object(kept)

    def agree(self, tokens: torch.Tensor | None) -> list[int]:
        """A proposal round's (S,) tokens, rank 0's on every rank (the same list at TP 1)."""
        if self.tp.world_size == 1:
            assert tokens is not None
            return tokens.tolist()
        return self.tp.broadcast_object(tokens.tolist() if self.tp.is_first else None)

    def greedy(self, inputs: ModelInputs, logits: torch.Tensor | None) -> torch.Tensor | None:
        """(S, V) draft logits of `inputs.sampled`'s rows -> (S,) drafts: the argmax, within each
        sequence's grammar while a proposal for constrained sequences runs (structured/draft_mask.py).
        None where the logits are (a rank of a sharded draft other than the first)."""
        if logits is None:
            return None
        if self.draft_mask is None:
            return logits.argmax(dim=-1)
        return self.draft_mask.argmax([s.seq_id for s in inputs.sampled], logits)

    def propose(self, step: StepMessage, inputs: ModelInputs, sampled: dict[int, SampledTokens] | None,
                draft_mask: DraftMask | None = None) -> dict[int, list[int]]:
        """seq_id -> its proposed tokens for the next step (sequences that sampled and have room).
        Every rank calls it after the step's sampling, `sampled` being rank 0's (None elsewhere);
        `draft_mask`: rank 0's grammars of the sequences that carry one (rolled back after the loop)."""
        self.draft_mask = draft_mask
        try:
            return self._propose(step, inputs, sampled)
        finally:
            self.draft_mask = None
            if draft_mask is not None:
                draft_mask.close()

    @torch.inference_mode()
    def _propose(self, step: StepMessage, inputs: ModelInputs, sampled: dict[int, SampledTokens] | None) -> dict[int, list[int]]:
        if not self.cache.is_allocated:  # the memory profile's forward runs before any cache
            return {}
        if self.lags:
            # A sequence left out of a step (preempted: recomputed later from before its lag; or
            # finished: only rank 0 is told of a release) drops its lag, on every rank alike
            self.lags = {s.seq_id: self.lags[s.seq_id] for s in step.seqs if s.seq_id in self.lags}
        if self.cap(step) == 0 and self.defers_catch_up:
            self.defer(step)
            return {}
        plans = self.catch_up_rows(step, inputs, self.kept(step, sampled))
        if self.defers_catch_up:
            plans = self.within_budget(plans)
        plans = [p for p in plans if p.token_ids]
        if not plans:
            return {}
        plans.sort(key=lambda p: len(p.token_ids) != 1)  # attention's order: one-token rows first
        seqs, rows = [], 0
        for p in plans:
            last = p.start_pos + len(p.token_ids) - 1 + max(p.num_drafts - 1, 0)
            # a sampled row's new token (and its lookahead) may lie past the allocated blocks
            table = self.cache.table_with_scratch(p.block_table, last, rows)
            rows += len(table) > len(p.block_table)
            seqs.append(SeqStep(p.seq_id, p.token_ids, p.start_pos, table, p.num_drafts > 0))
        hidden = torch.cat([p.hidden for p in plans]) if plans[0].hidden is not None else None
        tokens, nxt = self.forward(seqs, hidden)
        active = [(s, p.num_drafts) for s, p in zip(seqs, plans) if p.num_drafts > 0]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s, _ in active}
        for j in range(max((n for _, n in active), default=0)):
            for (s, _), t in zip(active, self.agree(tokens)):
                drafts[s.seq_id].append(t)
            keep = [i for i, (_, n) in enumerate(active) if n > j + 1]
            if not keep:
                break
            # one token each at the position after the last fed one, on the same (scratch-extended) table
            fed = [SeqStep(s.seq_id, [drafts[s.seq_id][-1]], s.context_len + j, s.block_table, True)
                   for s, _ in (active[i] for i in keep)]
            index = torch.tensor(keep, device=self.device)
            tokens, nxt = self.forward(fed, nxt.index_select(0, index) if nxt is not None else None)
            active = [active[i] for i in keep]
        return drafts

    def forward(self, seqs: list[SeqStep], hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.num_draft_forwards += 1
        return self.run(seqs, hidden)

    def forward_inputs(self, seqs: list[SeqStep]) -> ModelInputs:
        return prepare_inputs(StepMessage(seqs), self.block_size, self.device)


class DraftModelDrafter(Drafter):
    """method "draft_model": any checkpoint Stoker serves, of the target's vocabulary."""

    def __init__(self, config: EngineConfig, model: nn.Module, cache: DraftKVCache, max_model_len: int,
                 device: torch.device, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(config, cache, max_model_len, device, tp)
        self.model = model

    def catch_up_rows(self, step: StepMessage, inputs: ModelInputs, kept: dict[int, Kept]) -> list[DraftRows]:
        """What the draft skipped while k was 0 (its lag), the target's known tokens of the step, then
        what it kept (accepted drafts, the new token): the new token's row proposes the first draft."""
        plans = []
        for s in step.seqs:
            got = kept.get(s.seq_id) if s.do_sample else None
            if got is None:
                tokens, num = list(s.token_ids), 0
            else:
                tokens, num = s.token_ids[: s.num_tokens - len(s.draft_token_ids)] + got.token_ids, got.num_drafts
            tokens, start = self.with_lag(s.seq_id, tokens, s.start_pos)
            plans.append(DraftRows(s.seq_id, tokens, start, s.block_table, num))
        return plans

    def run(self, seqs: list[SeqStep], hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        inputs = self.forward_inputs(seqs)
        with set_forward_context(ForwardContext(inputs.attn_metadata)):
            out = self.model(inputs.input_ids, inputs.positions)  # (T, hidden)
        if not inputs.sampled:
            return torch.empty(0, dtype=torch.int64), None
        # (S, vocab) on rank 0; None on the other ranks of a sharded draft (still a collective: all call it)
        logits = self.model.compute_logits(out[inputs.logits_indices])
        return self.greedy(inputs, logits), None
