"""The step round trip: the plan that crosses into a runner, and the result that comes back. [no torch]

One contract for every runner (DESIGN.md, seams 17 and 21): the in-process runner at TP=1, and
every tensor-parallel rank, which receives the message pickled over torch.distributed. Both
directions hold plain values only (ints, lists, the request's SamplingParams), never a
`Sequence` or the scheduler. The scheduler plans a `StepMessage`, the runner answers a
`StepResult`, and `Scheduler.update_after_step(plan, result)` learns what happened from it.

Forward part (every rank needs it): per scheduled sequence its new token ids, the position of
the first one, its block table and whether its last position samples.
Sampling part (only the rank that samples, rank 0, needs it): per sampling row its params,
which of the request's n completions it is (seeds its generator), how many tokens it has
generated (min_tokens) and, only when a penalty or bad_words needs them, its prompt and output
ids. `for_workers()` drops the sampling part, so a broadcast carries the forward only.

Optional parts, empty unless a capability fills them (absent costs nothing):
  * per sequence `draft_token_ids`: proposed tokens at the tail of `token_ids`, to verify; the
    sequence then samples `num_sampled` = 1 + len(drafts) rows (speculative decoding);
  * per step `kv_copies`: (source, destination) block pairs the runner copies in every layer's
    cache before the forward (done when the result comes back: they run in the step);
  * per step `kv_host_saves` / `kv_host_loads`: block copies between the device cache and the
    host KV tier, run before `kv_copies` and the forward (core/host_kv_pool.py);
  * per step `kv_connector_meta`: what a KV connector's worker side needs this step (its
    handles reach the layers through the forward context); transfers it finishes come back
    in `StepResult.finished_sending` / `finished_recving` (vLLM's names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from stoker.core.scheduler import ScheduledSequence, SchedulerOutput
from stoker.core.sequence import Sequence
from stoker.sampling_params import SamplingParams


# SampleSpec and SeqStep are made per sequence per step: plain slotted dataclasses, not frozen
# (a frozen one sets each field through object.__setattr__, 4x the cost). Treat them as values.
@dataclass(slots=True)
class SampleSpec:
    params: SamplingParams
    index: int  # which of the request's n completions: a seeded row draws from seed + index
    num_output_tokens: int
    # (prompt ids, output ids) when a penalty or bad_words needs them, else None
    history_ids: tuple[list[int], list[int]] | None = None
    # bad_words as token ids (with and without a leading space); the last of each is banned
    # where the output ends with the rest (engine/input_processor.py tokenizes them once)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(slots=True)
class SeqStep:
    seq_id: int
    token_ids: list[int]  # the tokens computed this step: positions [start_pos, start_pos + len)
    start_pos: int
    block_table: list[int]
    do_sample: bool
    # prompt_logprobs: (top n, the prompt tokens the positions [start_pos, start_pos + len)
    # predict). Every rank needs it: the LM head's gather is a collective over those rows.
    prompt_logprobs: tuple[int, list[int]] | None = None
    lora_slot: int = -1  # the LoRA slot its adapter is in (-1: the base model)
    # Proposed tokens to verify: the last len(draft_token_ids) of token_ids (speculative decoding)
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        """Rows this sequence samples: the last known token's and one per draft (derived, so it
        can never disagree with the drafts it verifies)."""
        return 1 + len(self.draft_token_ids) if self.do_sample else 0

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepShape:
    """What one step computed, in the roofline's terms (the live wall verdict prices it)."""

    num_prefill_tokens: int  # prompt tokens of every prefill chunk in the step
    prefill_attended: int  # sum over those tokens of the positions each attends (causal: p + 1)
    num_decode_seqs: int  # sequences that computed one known token (with or without drafts after it)
    decode_context: int  # sum of the decode sequences' context lengths (KV read)
    num_sampled: int  # rows of logits (a sequence verifying drafts samples 1 + len(drafts))
    # Speculative decoding: drafted tokens verified after their sequence's decode token, and the
    # positions they attend in all (the sequence's context, read once by its decode, and the
    # drafts before them). A verify step is a decode that computes 1 + k tokens per sequence.
    num_draft_tokens: int = 0
    draft_attended: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs + self.num_draft_tokens

    @property
    def kind(self) -> str:
        if self.num_prefill_tokens and self.num_decode_seqs:
            return "mixed"
        return "prefill" if self.num_prefill_tokens else "decode"


@dataclass(frozen=True)
class StepMessage:
    seqs: list[SeqStep]  # decodes (one new token) first, then prefills: attention's order
    # seq_id -> how it samples; only for seqs with do_sample, and only on the sampling rank
    sampling: dict[int, SampleSpec] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    # (source block, destination block): copied in every layer's K and V cache before the forward
    kv_copies: tuple[tuple[int, int], ...] = ()
    kv_connector_meta: Any = None  # a KV connector's per-step metadata (None: no connector)
    # Host KV tier (core/host_kv_pool.py), run before the forward in this order on every rank (each
    # copies its own shard): (device block, host slot) saves, then (host slot, device block) loads
    kv_host_saves: tuple[tuple[int, int], ...] = ()
    kv_host_loads: tuple[tuple[int, int], ...] = ()
    # draft_model / eagle3: the most proposals a sequence gets after this step, the k the cost
    # model chose (core/spec_k_policy.py; 0: no draft forward this step); None: the configured k.
    # Every rank reads it, so the drafter's lockstep loop skips or runs on all of them alike
    num_speculative_tokens: int | None = None

    @property
    def sampled_seq_ids(self) -> list[int]:
        """The sequences that sample, in row order of the sampler's output."""
        return [s.seq_id for s in self.seqs if s.do_sample]

    def shape(self) -> StepShape:
        """A sequence with one known token is a decode (a one-token prefill chunk prices the same);
        its drafts, if any, are verified tokens attending the context it reads (not a prefill
        chunk, which would write their K/V without reading the context's)."""
        prefill = attended = decodes = context = drafts = draft_attended = num_sampled = 0
        for s in self.seqs:
            n = len(s.token_ids)
            d = len(s.draft_token_ids)
            if s.do_sample:
                num_sampled += 1 + d
            if n - d == 1:
                decodes += 1
                start = s.start_pos
                context += start + 1
                if d:  # d_j at position start_pos + 1 + j attends start_pos + 2 + j
                    drafts += d
                    draft_attended += d * (start + 1) + d * (d + 1) // 2
            else:
                prefill += n
                attended += n * s.start_pos + n * (n + 1) // 2
        return StepShape(prefill, attended, decodes, context, num_sampled, drafts, draft_attended)

    def for_workers(self) -> StepMessage:
        """The forward part alone: what a rank that does not sample needs."""
        return dataclasses.replace(self, sampling={}, eos_token_ids=())


@dataclass
class PromptLogprobChunk:
    """Scores of prompt tokens [first_index, first_index + len(logprobs)) of one sequence."""

    first_index: int  # index into the prompt of the first token scored
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 = the model's most likely token at that position
    top_ids: list[list[int]]  # (len, top n)
    top_logprobs: list[list[float]]


@dataclass(slots=True)  # one per sampled sequence per step: plain, not frozen (4x cheaper to make)
class SampledTokens:
    """What one sequence kept from a step: its accepted tokens in order (one per step without
    drafts; with drafts, the accepted ones and the token sampled after them), each with its
    log-probability and, when the request asks for logprobs, (its rank, the top ids, their values)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[int, list[int], list[float]] | None]


@dataclass
class StepResult:
    """What a step did, as rank 0 saw it; the scheduler and the output processor learn from it."""

    # seq_id -> its accepted tokens, for every sequence that sampled, in the message's row order
    sampled: dict[int, SampledTokens] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobChunk] = field(default_factory=dict)  # seq_id -> scores
    # Request ids whose KV transfers a KV connector finished this step (vLLM's names): sending
    # (their blocks may go) and receiving (their prompt's K/V arrived). Empty without a connector.
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    # seq_id -> tokens a draft model proposed after this step's accepted ones (draft_model, eagle3:
    # spec_decode/drafter.py); the engine puts them on the sequence for the next step to verify
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # The connector's failed reads and each read's (seconds, bytes): stoker/kv_transfer/metadata.py
    kv_connector_output: Any = None


def _needs_history(p: SamplingParams) -> bool:
    """Penalties count the prompt's and output's tokens; bad words look at the output's tail."""
    return p.repetition_penalty != 1 or bool(p.frequency_penalty) or bool(p.presence_penalty) or bool(p.bad_words)


def _prompt_logprob_targets(seq: Sequence, start_pos: int, num_tokens: int) -> tuple[int, list[int]] | None:
    """Position p's logits score prompt token p + 1: a chunk [start, start + n) scores the
    prompt tokens [start + 1, min(start + n, prompt_len - 1) + 1). None when nothing is asked
    or the chunk holds only the prompt's last token or outputs (recompute after preemption)."""
    if not seq.wants_prompt_logprobs:
        return None
    targets = seq.prompt_token_ids[start_pos + 1 : min(start_pos + num_tokens, seq.num_prompt_tokens - 1) + 1]
    return (seq.sampling_params.prompt_logprobs, targets) if targets else None


def build_step(out: SchedulerOutput, eos_token_ids: tuple[int, ...], lora_slots: dict[str, int] | None = None) -> StepMessage:
    """The message for one planned step: decodes first, then prefills, each grouped by LoRA slot
    (so an adapter's tokens are contiguous: layers/lora.py multiplies each run once); stable
    otherwise. lora_slots: adapter name -> the slot it is loaded in, for every adapter of the
    step's sequences."""

    def slot_of(s: ScheduledSequence) -> int:
        name = s.seq.lora_name
        return lora_slots[name] if name is not None and lora_slots is not None else -1

    scheduled = out.scheduled
    if lora_slots or any(s.num_tokens != 1 for s in scheduled):
        ordered = sorted(scheduled, key=lambda s: (s.num_tokens != 1, slot_of(s)))
    else:
        ordered = scheduled  # all decodes of the base model: the sort keeps them as they are
    seqs: list[SeqStep] = []
    sampling: dict[int, SampleSpec] = {}
    for s in ordered:
        seq = s.seq
        num_drafts = s.num_draft_tokens
        name = seq.lora_name
        slot = lora_slots[name] if name is not None and lora_slots is not None else -1
        p = seq.sampling_params
        prompt_logprobs = (_prompt_logprob_targets(seq, s.start_pos, s.num_tokens - num_drafts)
                           if p.prompt_logprobs is not None and seq.index == 0 else None)  # seq.wants_prompt_logprobs
        start = s.start_pos
        output_ids = seq.output_token_ids
        if s.num_tokens == 1 and not num_drafts:  # one known token (a decode): s.token_ids, inlined
            num_prompt = len(seq.prompt_token_ids)
            token_ids = [output_ids[start - num_prompt] if start >= num_prompt else seq.prompt_token_ids[start]]
        else:
            token_ids = s.token_ids
        seqs.append(SeqStep(seq.seq_id, token_ids, start, list(s.block_table), s.do_sample,
                            prompt_logprobs, slot, tuple(s.draft_token_ids) if num_drafts else ()))
        if s.do_sample:
            history_ids = (seq.prompt_token_ids, list(output_ids)) if _needs_history(p) else None
            sampling[seq.seq_id] = SampleSpec(p, seq.index, len(output_ids), history_ids, seq.bad_words_token_ids)
    return StepMessage(seqs, sampling, tuple(eos_token_ids), tuple(out.kv_copies),
                       kv_host_saves=tuple(out.kv_host_saves), kv_host_loads=tuple(out.kv_host_loads))
