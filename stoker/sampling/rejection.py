"""Verifying drafted tokens: which of a sequence's drafts to keep, and the token after them.

A sequence with k drafts d_0..d_{k-1} samples k + 1 rows of logits in one forward: row j is the
target model's distribution p_j for the token after d_0..d_{j-1}. Each row is prepared exactly as
the sampler prepares a row (penalties over the output with the earlier drafts appended,
min_tokens, logit_bias, allowed_token_ids, bad_words; temperature, top-k, top-p, min-p), then:

  * greedy row: d_j is accepted when it is the row's argmax; otherwise the argmax replaces it.
  * random row: d_j is accepted with probability p_j(d_j) (the rule of Leviathan et al., "Fast
    Inference from Transformers via Speculative Decoding", 2023, for a draft distribution q that
    is one-hot on d_j, as an n-gram's is: min(1, p/q) = p(d_j)); on rejection the replacement is
    drawn from norm(max(p_j - q, 0)) = p_j with d_j removed, renormalised. The token emitted at a
    row is then distributed exactly as p_j: p(d) + (1 - p(d)) * 0 for d, and
    (1 - p(d)) * p(x) / (1 - p(d)) = p(x) for every other x.
  * the last row (no draft) is the bonus: a plain sample of p_k, kept when every draft passed.

A sequence keeps its rows up to and including its first rejected one: the accepted drafts, then
one new token. Greedy output is therefore token for token what decoding without drafts gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stoker.core.step import SampledTokens
from stoker.sampling.sampler import Sampler, SamplingRow


@dataclass(frozen=True)
class VerifyGroup:
    """One sequence's rows: `len(draft_token_ids) + 1` consecutive rows of the logits."""

    seq_id: int
    draft_token_ids: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


def residual(probs: torch.Tensor, draft_ids: torch.Tensor, has_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) for a one-hot q, up to normalisation (the draw normalises): (R, V)
    `probs` with each drafted row's draft token zeroed; rows without a draft are left as they are."""
    at_draft = probs.gather(1, draft_ids[:, None])  # (R, 1); draft_ids >= 0 on every row
    keep = torch.where(has_draft[:, None], torch.zeros_like(at_draft), at_draft)
    return probs.clone().scatter_(1, draft_ids[:, None], keep)  # no host sync (a GPU step stays async)


def accept_or_replace(sampler: Sampler, probs: torch.Tensor, draft_ids: list[int],
                      generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows: (R, V) target probabilities, R drafts (-1: a bonus row, no draft) ->
    ((R,) emitted tokens, (R,) accepted). Each row's uniform and noise come from its generator."""
    drafts = torch.tensor(draft_ids, dtype=torch.int64, device=probs.device)
    has_draft = drafts >= 0
    safe = drafts.clamp(min=0)
    p_draft = probs.gather(1, safe[:, None])[:, 0]  # (R,)
    # A uniform only for the rows with a draft: a row's draws depend on its own drafts alone,
    # never on whether another sequence in the batch drafted (seeded rows stay reproducible).
    drafted = [i for i, d in enumerate(draft_ids) if d >= 0]
    u = torch.ones_like(p_draft)  # 1: never below p, so a bonus row never "accepts"
    if drafted:
        u[torch.tensor(drafted, device=probs.device)] = sampler.uniform([generators[i] for i in drafted])
    accepted = has_draft & (u < p_draft)
    replacement = sampler.draw(residual(probs, safe, has_draft), generators)
    return torch.where(accepted, safe, replacement), accepted


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], groups: list[VerifyGroup]) -> dict[int, SampledTokens]:
    """logits: (N, V) float32, N = sum of the groups' rows, in group order; rows: one SamplingRow
    per logits row (row j of a group sees the output with the group's drafts 0..j-1 appended).
    -> seq_id -> its kept tokens with their logprobs (and top logprobs where asked)."""
    device = logits.device
    draft_list = [d for g in groups for d in (*g.draft_token_ids, -1)]
    assert len(draft_list) == len(rows) == logits.shape[0], (len(draft_list), len(rows), logits.shape)
    drafts = torch.tensor(draft_list, dtype=torch.int64, device=device)  # (N,)
    raw_logprobs, prepared = sampler.prepare(logits, rows)
    target = prepared.argmax(dim=-1)  # (N,) greedy rows' tokens
    emitted = target.clone()
    accepted = (drafts >= 0) & (target == drafts)  # greedy rule, replaced below for random rows
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=device)
        probs = sampler.target_probs(prepared, rows, random_rows)  # (R, V)
        tokens, ok = accept_or_replace(sampler, probs, [draft_list[i] for i in random_rows],
                                       [rows[i].generator for i in random_rows])
        emitted[idx] = tokens
        accepted[idx] = ok
    # greedy rows: an accepted draft is the argmax itself, so `target` is already what they emit
    out = sampler.to_host(raw_logprobs, emitted, [r.params.logprobs for r in rows], flags=accepted)
    assert out.flags is not None
    result: dict[int, SampledTokens] = {}
    first = 0
    for g in groups:
        end = first
        while end < first + g.num_rows - 1 and out.flags[end]:
            end += 1  # rows first..end-1 accepted their drafts; row end emits the new token
        keep = slice(first, end + 1)
        result[g.seq_id] = SampledTokens(out.token_ids[keep], out.logprobs[keep], out.top_logprobs[keep])
        first += g.num_rows
    return result
