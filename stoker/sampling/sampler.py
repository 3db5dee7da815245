"""One batched sampling call per step; one host read of its results.

Order, per row: raw log-probabilities (what `logprobs` reports, as vLLM V1 does) ->
penalties -> min_tokens mask -> greedy argmax, or temperature -> top-k -> top-p -> min-p
-> a draw. Draws use the exponential-race trick (argmax of p / E, E ~ Exp(1) is a sample
from p), so a seeded row draws its noise from its own generator and gives the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stoker.sampling.penalties import apply_penalties
from stoker.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One row of logits' sampling: its request's params and the per-step facts they need.

    What the params ask for is read once, when the row is made (`greedy`, `plain`, `num_top`):
    a request's SamplingParams are fixed for its life, and the runner keeps a sequence's row
    from step to step (ModelRunner.sample), updating only `num_output_tokens` and the history."""

    params: SamplingParams
    prompt_ids: list[int]  # penalties only: empty when the row uses none
    output_ids: list[int]  # penalties only: empty when the row uses none
    num_output_tokens: int  # min_tokens
    generator: torch.Generator | None  # a seeded request's own stream; None: the shared one
    eos_token_ids: tuple[int, ...]
    # bad_words as token ids: the last of each is banned where the output ends with the rest
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    greedy: bool = field(init=False)  # params.is_greedy
    # nothing in `Sampler.prepare` touches this row's logits: no penalty, no min_tokens, no
    # logit_bias, allowed_token_ids or bad_words
    plain: bool = field(init=False)
    num_top: int | None = field(init=False)  # params.logprobs

    def __post_init__(self) -> None:
        p = self.params
        self.greedy = p.is_greedy
        self.plain = not (_penalized(p) or p.min_tokens or _token_rules(p))
        self.num_top = p.logprobs


def _penalized(p: SamplingParams) -> bool:
    return bool(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty)


def _token_rules(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # (S,)
    logprobs: list[float]  # (S,) log-probability of each sampled token
    # Per row when asked: (rank of the sampled token, top ids, top logprobs).
    top_logprobs: list[tuple[int, list[int], list[float]] | None]
    flags: list[bool] | None = None  # the rejection sampler's: whether each row's draft was accepted


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
        raw_logprobs, logits = self.prepare(logits, rows)
        sampled = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=self.device)
            probs = self.target_probs(logits, rows, random_rows)
            sampled[idx] = self.draw(probs, [rows[i].generator for i in random_rows])
        return self.to_host(raw_logprobs, sampled, [r.num_top for r in rows])

    def _col(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def prepare(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, V) logits -> (raw log-probabilities, what `logprobs` reports; the logits after
        penalties, min_tokens, logit_bias, allowed_token_ids and bad_words: greedy takes their argmax)."""
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        for r in rows:
            if not r.plain:
                break
        else:  # the common batch: no row asks for any of it (one pass, not one per rule)
            return raw_logprobs, logits
        params = [r.params for r in rows]
        col = self._col
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
        return raw_logprobs, logits

    def target_probs(self, logits: torch.Tensor, rows: list[SamplingRow], random_rows: list[int]) -> torch.Tensor:
        """The distribution a random row draws from: (R, V) probabilities of rows `random_rows`
        of the prepared logits after temperature, top-k, top-p and min-p."""
        params = [rows[i].params for i in random_rows]
        idx = torch.tensor(random_rows, device=self.device)
        sub = logits[idx] / self._col([p.temperature for p in params])[:, None]
        if any(p.top_k > 0 for p in params):
            sub = _mask_top_k(sub, torch.tensor([p.top_k for p in params], device=self.device))
        if any(p.top_p < 1 for p in params):
            sub = _mask_top_p(sub, self._col([p.top_p for p in params]))
        if any(p.min_p > 0 for p in params):
            sub = _mask_min_p(sub, self._col([p.min_p for p in params]))
        return sub.softmax(dim=-1)

    def draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of (R, V) `probs` (need not sum to 1: argmax of p / E, E ~ Exp(1),
        samples from p normalized), each row's noise from its own generator or the shared one."""
        noise = torch.empty_like(probs)
        for j, g in enumerate(generators):  # row by row: a seeded row's tokens never depend on the batch
            noise[j].exponential_(generator=g or self.generator)
        return (probs / noise).argmax(dim=-1)

    def uniform(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """(R,) draws from U[0, 1), each from its row's generator or the shared one."""
        u = torch.empty(len(generators), dtype=torch.float32, device=self.device)
        for j, g in enumerate(generators):
            u[j : j + 1].uniform_(generator=g or self.generator)
        return u

    def to_host(self, raw_logprobs: torch.Tensor, sampled: torch.Tensor, want_top: list[int | None],
                flags: torch.Tensor | None = None) -> SamplerOutput:
        """The one host read of the step: the (S,) sampled tokens, their logprobs and, per row
        that asks, (rank, top ids, top logprobs); `flags`, an (S,) bool column, comes back in
        `SamplerOutput.flags` (the rejection sampler's accepted rows)."""
        num_rows, vocab = raw_logprobs.shape
        token_logprobs = raw_logprobs.gather(1, sampled[:, None])[:, 0]
        top_k = max((k for k in want_top if k is not None), default=None)
        ranks = top_ids = top_vals = None
        if top_k is not None:
            ranks = (raw_logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
            if top_k > 0:
                top_vals, top_ids = raw_logprobs.topk(min(top_k, vocab), dim=-1)
        # Packed into one tensor (float64 holds token ids and ranks exactly).
        # Columns: token, logprob, [flag], [rank, ids, vals].
        columns = [sampled.double()[:, None], token_logprobs.double()[:, None]]
        if flags is not None:
            columns.append(flags.double()[:, None])
        first = len(columns)
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
            for i, k in enumerate(want_top):
                if k is not None:
                    r = host[i]
                    ids = [int(t) for t in r[first + 1 : first + 1 + width]]
                    tops[i] = (int(r[first]), ids[:k], r[first + 1 + width :][:k])
        flag_list = [r[2] != 0 for r in host] if flags is not None else None
        return SamplerOutput(token_list, logprob_list, tops, flag_list)

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
