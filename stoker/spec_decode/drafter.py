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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from stoker.config import EngineConfig
from stoker.core.step import SampledTokens, SeqStep, StepMessage
from stoker.layers.forward_context import ForwardContext, set_forward_context
from stoker.runner.inputs import ModelInputs, prepare_inputs
from stoker.spec_decode.draft_cache import DraftKVCache

if TYPE_CHECKING:
    from stoker.structured.draft_mask import DraftMask


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

    def __init__(self, config: EngineConfig, cache: DraftKVCache, max_model_len: int, device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.cache = cache
        self.block_size = config.cache_config.block_size
        self.max_model_len = max_model_len
        self.device = device
        self.draft_mask: DraftMask | None = None  # during a proposal for sequences with a grammar

    # ---- what a method provides
    def catch_up_rows(self, step: StepMessage, inputs: ModelInputs, sampled: dict[int, SampledTokens]) -> list[DraftRows]:
        raise NotImplementedError

    def run(self, seqs: list[SeqStep], hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward -> ((S,) greedy tokens of the S sampling rows, in order; (S, hidden)
        the hidden input of each row's next step, or None for a method that needs none)."""
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        pass

    # ---- the loop
    def num_drafts(self, step: StepMessage, seq_id: int, accepted: list[int], new_pos: int) -> int:
        """Proposals worth making for a sequence whose newest token sits at `new_pos`: within
        max_model_len and max_tokens (the step keeps the drafts and one more), none after EOS."""
        spec = step.sampling.get(seq_id)
        if spec is None:
            return 0
        room = min(self.k, self.max_model_len - new_pos - 2)
        params = spec.params
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - spec.num_output_tokens - len(accepted) - 1)
        if not params.ignore_eos and accepted[-1] in step.eos_token_ids:
            return 0
        return max(room, 0)

    def greedy(self, inputs: ModelInputs, logits: torch.Tensor) -> torch.Tensor:
        """(S, V) draft logits of `inputs.sampled`'s rows -> (S,) drafts: the argmax, within each
        sequence's grammar while a proposal for constrained sequences runs (structured/draft_mask.py)."""
        if self.draft_mask is None:
            return logits.argmax(dim=-1)
        return self.draft_mask.argmax([s.seq_id for s in inputs.sampled], logits)

    def propose(self, step: StepMessage, inputs: ModelInputs, sampled: dict[int, SampledTokens],
                draft_mask: DraftMask | None = None) -> dict[int, list[int]]:
        """seq_id -> its proposed tokens for the next step (sequences that sampled and have room);
        `draft_mask`: the grammars of the sequences that carry one (rolled back after the loop)."""
        self.draft_mask = draft_mask
        try:
            return self._propose(step, inputs, sampled)
        finally:
            self.draft_mask = None
            if draft_mask is not None:
                draft_mask.close()

    @torch.inference_mode()
    def _propose(self, step: StepMessage, inputs: ModelInputs, sampled: dict[int, SampledTokens]) -> dict[int, list[int]]:
        if not self.cache.is_allocated:  # the memory profile's forward runs before any cache
            return {}
        plans = [p for p in self.catch_up_rows(step, inputs, sampled) if p.token_ids]
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
        tokens, nxt = self.run(seqs, hidden)
        active = [(s, p.num_drafts) for s, p in zip(seqs, plans) if p.num_drafts > 0]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s, _ in active}
        for j in range(max((n for _, n in active), default=0)):
            for (s, _), t in zip(active, tokens.tolist()):
                drafts[s.seq_id].append(t)
            keep = [i for i, (_, n) in enumerate(active) if n > j + 1]
            if not keep:
                break
            # one token each at the position after the last fed one, on the same (scratch-extended) table
            fed = [SeqStep(s.seq_id, [drafts[s.seq_id][-1]], s.context_len + j, s.block_table, True)
                   for s, _ in (active[i] for i in keep)]
            index = torch.tensor(keep, device=self.device)
            tokens, nxt = self.run(fed, nxt.index_select(0, index) if nxt is not None else None)
            active = [active[i] for i in keep]
        return drafts

    def forward_inputs(self, seqs: list[SeqStep]) -> ModelInputs:
        return prepare_inputs(StepMessage(seqs), self.block_size, self.device)


class DraftModelDrafter(Drafter):
    """method "draft_model": any checkpoint Stoker serves, of the target's vocabulary."""

    def __init__(self, config: EngineConfig, model: nn.Module, cache: DraftKVCache, max_model_len: int,
                 device: torch.device) -> None:
        super().__init__(config, cache, max_model_len, device)
        self.model = model

    def catch_up_rows(self, step: StepMessage, inputs: ModelInputs, sampled: dict[int, SampledTokens]) -> list[DraftRows]:
        """The target's known tokens of the step, then what it kept (accepted drafts, the new
        token): the new token's row proposes the first draft."""
        plans = []
        for s in step.seqs:
            if not s.do_sample or s.seq_id not in sampled:
                plans.append(DraftRows(s.seq_id, s.token_ids, s.start_pos, s.block_table, 0))
                continue
            accepted = sampled[s.seq_id].token_ids
            tokens = s.token_ids[: s.num_tokens - len(s.draft_token_ids)] + accepted
            new_pos = s.start_pos + len(tokens) - 1
            plans.append(DraftRows(s.seq_id, tokens, s.start_pos, s.block_table,
                                   self.num_drafts(step, s.seq_id, accepted, new_pos)))
        return plans

    def run(self, seqs: list[SeqStep], hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        inputs = self.forward_inputs(seqs)
        with set_forward_context(ForwardContext(inputs.attn_metadata)):
            out = self.model(inputs.input_ids, inputs.positions)  # (T, hidden)
        if not inputs.sampled:
            return torch.empty(0, dtype=torch.int64), None
        logits = self.model.compute_logits(out[inputs.logits_indices])  # (S, vocab)
        return self.greedy(inputs, logits), None
