"""One batched sampling call per step; one host read of its results.

Order, per row: raw log-probabilities (what `logprobs` reports, as vLLM V1 does) ->
penalties -> min_tokens mask -> greedy argmax, or temperature -> top-k -> top-p -> min-p
-> a draw. Draws use the exponential-race trick (argmax of p / E, E ~ Exp(1) is a sample
from p), so a seeded row draws its noise from its own generator and gives the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stoker.sampling.penalties import apply_penalties
from stoker.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]  # penalties only: empty when the row uses none
    output_ids: list[int]  # penalties only: empty when the row uses none
    num_output_tokens: int  # min_tokens
    generator: torch.Generator | None  # a seeded request's own stream; None: the shared one
    eos_token_ids: tuple[int, ...]
    # bad_words as token ids: the last of each is banned where the output ends with the rest
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@dataclass
class SamplerOutput:
    token_ids: list[int]  # (S,)
    logprobs: list[float]  # (S,) log-probability of each sampled token
    # Per row when asked: (rank of the sampled token, top ids, top logprobs).
    top_logprobs: list[tuple[int, list[int], list[float]] | None]


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k = 0: keep all). Ties at the k-th value are kept."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    remove_sorted = mass_before >= top_p[:, None]
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _mask_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p x the most likely token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: (S, V) float32, one row per sequence that samples this step."""
        num_rows, vocab = logits.shape
        params = [r.params for r in rows]
        want_top = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1)

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device)

        if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
            logits = apply_penalties(
                logits,
                [r.prompt_ids for r in rows],
                [r.output_ids for r in rows],
                col([p.repetition_penalty for p in params]),
                col([p.frequency_penalty for p in params]),
                col([p.presence_penalty for p in params]),
                any_repetition=any(p.repetition_penalty != 1 for p in params),
            )
        logits = self._mask_early_stops(logits, rows)
        if any(p.logit_bias or p.allowed_token_ids or p.bad_words for p in params):
            logits = self._apply_token_rules(logits, rows)

        is_greedy = [p.is_greedy for p in params]
        sampled = logits.argmax(dim=-1)
        random_rows = [i for i, g in enumerate(is_greedy) if not g]
        if random_rows:
            idx = torch.tensor(random_rows, device=self.device)
            sub = logits[idx] / col([params[i].temperature for i in random_rows])[:, None]
            if any(params[i].top_k > 0 for i in random_rows):
                sub = _mask_top_k(sub, torch.tensor([params[i].top_k for i in random_rows], device=self.device))
            if any(params[i].top_p < 1 for i in random_rows):
                sub = _mask_top_p(sub, col([params[i].top_p for i in random_rows]))
            if any(params[i].min_p > 0 for i in random_rows):
                sub = _mask_min_p(sub, col([params[i].min_p for i in random_rows]))
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=rows[i].generator or self.generator)
            sampled[idx] = (probs / noise).argmax(dim=-1)

        token_logprobs = raw_logprobs.gather(1, sampled[:, None])[:, 0]
        top_k = max((k for k in want_top if k is not None), default=None)
        ranks = top_ids = top_vals = None
        if top_k is not None:
            ranks = (raw_logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
            if top_k > 0:
                top_vals, top_ids = raw_logprobs.topk(min(top_k, vocab), dim=-1)
        # The one host read of the step: everything the host needs, packed into one tensor
        # (float64 holds token ids and ranks exactly). Columns: token, logprob, [rank, ids, vals].
        columns = [sampled.double()[:, None], token_logprobs.double()[:, None]]
        width = 0
        if top_k is not None:
            columns.append(ranks.double()[:, None])
            if top_ids is not None:
                width = top_ids.shape[1]
                columns += [top_ids.double(), top_vals.double()]
        host = torch.cat(columns, dim=1).cpu().tolist()
        token_list = [int(r[0]) for r in host]
        logprob_list = [r[1] for r in host]
        tops: list[tuple[int, list[int], list[float]] | None] = [None] * num_rows
        if top_k is not None:
            rank_list = [int(r[2]) for r in host]
            ids_list = [[int(t) for t in r[3 : 3 + width]] for r in host]
            vals_list = [r[3 + width :] for r in host]
            for i, k in enumerate(want_top):
                if k is not None:
                    tops[i] = (rank_list[i], ids_list[i][:k], vals_list[i][:k])
        return SamplerOutput(token_list, logprob_list, tops)

    def _apply_token_rules(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Per row: logit_bias added; only allowed_token_ids kept; a bad word's last token
        banned where the output ends with the rest of it (one token: always)."""
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
                logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device))
            if p.allowed_token_ids:
                keep = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=logits.device)
                keep[p.allowed_token_ids] = 0.0
                logits[i] += keep
            for word in r.bad_words_token_ids:
                *prefix, last = word
                if last < vocab and (not prefix or r.output_ids[len(r.output_ids) - len(prefix):] == list(prefix)):
                    logits[i, last] = float("-inf")
        return logits

    def _mask_early_stops(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Below min_tokens, EOS and stop_token_ids cannot be sampled."""
        for i, r in enumerate(rows):
            p = r.params
            if r.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                if banned:
                    logits[i, [t for t in banned if t < logits.shape[1]]] = float("-inf")
        return logits
