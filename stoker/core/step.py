"""The step message: what the scheduler's plan becomes when it crosses into a runner. [no torch]

One contract for every runner (DESIGN.md, seam 17): the in-process runner at TP=1, and every
tensor-parallel rank, which receives it pickled over torch.distributed. It holds plain values
only (ints, lists, the request's SamplingParams), never a `Sequence` or the scheduler.

Forward part (every rank needs it): per scheduled sequence its new token ids, the position of
the first one, its block table and whether its last position samples.
Sampling part (only the rank that samples, rank 0, needs it): per sampling row its params,
which of the request's n completions it is (seeds its generator), how many tokens it has
generated (min_tokens) and, only when a penalty or bad_words needs them, its prompt and output
ids. `for_workers()` drops the sampling part, so a broadcast carries the forward only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from stoker.core.scheduler import ScheduledSequence, SchedulerOutput
from stoker.core.sequence import Sequence
from stoker.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleSpec:
    params: SamplingParams
    index: int  # which of the request's n completions: a seeded row draws from seed + index
    num_output_tokens: int
    # (prompt ids, output ids) when a penalty or bad_words needs them, else None
    history_ids: tuple[list[int], list[int]] | None = None


@dataclass(frozen=True)
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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepShape:
    """What one step computed, in the roofline's terms (the live wall verdict prices it)."""

    num_prefill_tokens: int  # prompt tokens of every prefill chunk in the step
    prefill_attended: int  # sum over those tokens of the positions each attends (causal: p + 1)
    num_decode_seqs: int  # sequences that computed one token
    decode_context: int  # sum of the decode sequences' context lengths (KV read)
    num_sampled: int  # rows of logits

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

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

    @property
    def sampled_seq_ids(self) -> list[int]:
        """The sequences that sample, in row order of the sampler's output."""
        return [s.seq_id for s in self.seqs if s.do_sample]

    def shape(self) -> StepShape:
        """A sequence with one new token is a decode (a one-token prefill chunk prices the same)."""
        prefill = attended = decodes = context = 0
        for s in self.seqs:
            if s.num_tokens == 1:
                decodes += 1
                context += s.context_len
            else:
                n = s.num_tokens
                prefill += n
                attended += n * s.start_pos + n * (n + 1) // 2
        return StepShape(prefill, attended, decodes, context, sum(1 for s in self.seqs if s.do_sample))

    def for_workers(self) -> StepMessage:
        """The forward part alone: what a rank that does not sample needs."""
        return dataclasses.replace(self, sampling={}, eos_token_ids=())


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
    (so an adapter's tokens are contiguous: lora/layers.py multiplies each run once); stable
    otherwise. lora_slots: adapter name -> the slot it is loaded in, for every adapter of the
    step's sequences."""

    def slot_of(s: ScheduledSequence) -> int:
        name = s.seq.lora_name
        return lora_slots[name] if name is not None and lora_slots is not None else -1

    ordered = sorted(out.scheduled, key=lambda s: (s.num_tokens != 1, slot_of(s)))
    seqs: list[SeqStep] = []
    sampling: dict[int, SampleSpec] = {}
    for s in ordered:
        seq = s.seq
        slot = slot_of(s)
        seqs.append(SeqStep(seq.seq_id, s.token_ids, s.start_pos, list(s.block_table), s.do_sample,
                            _prompt_logprob_targets(seq, s.start_pos, s.num_tokens), slot))
        if s.do_sample:
            p = seq.sampling_params
            history_ids = (seq.prompt_token_ids, list(seq.output_token_ids)) if _needs_history(p) else None
            sampling[seq.seq_id] = SampleSpec(p, seq.index, seq.num_output_tokens, history_ids)
    return StepMessage(seqs, sampling, tuple(eos_token_ids))
