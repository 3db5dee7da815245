"""One sequence being generated: its tokens, how many are in the KV cache, its status. [no torch]

A request with `n > 1` becomes n sequences that share the prompt; their full prompt
blocks are shared through the prefix cache (see `Scheduler._can_admit`).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from stoker.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Holds its blocks while a KV connector reads its prompt's K/V from a remote engine; never
    # scheduled until the read arrives (stoker/kv_transfer/scheduler_side.py)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    index: int = 0  # which of the request's n completions this is
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache. The first `num_cached_tokens` of them came from
    # the prefix cache at admission rather than from a forward pass.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Sibling sequences (n > 1) wait for the first to fill the prompt's blocks.
    group_leader: "Sequence | None" = field(default=None, repr=False)
    # Filled by the engine: incremental text and per-token logprobs.
    output_text: str = ""
    cumulative_logprob: float = 0.0
    output_logprobs: list = field(default_factory=list, repr=False)
    # prompt_logprobs: one entry per prompt token (None for the first), filled by the engine
    # as prefill chunks compute them. Only the request's first sequence computes them.
    prompt_logprobs: list | None = field(default=None, repr=False)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # bad_words as token ids, tokenized once by the input processor (sampling bans them)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Proposed next tokens awaiting verification (speculative decoding): scheduled after the
    # known tokens, never part of token_ids; the step's result says which were accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    # The request's priority (lower runs first under the priority policy) and its prefix-cache
    # salt: blocks are shared only between sequences of the same salt (and adapter).
    priority: int = 0
    cache_salt: str | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None and self.index == 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is missing from the cache."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def append_tokens(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
