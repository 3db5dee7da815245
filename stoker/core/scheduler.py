"""Continuous batching: which sequences run this step, and how many tokens of each. [no torch]

One token budget per step (`max_num_batched_tokens`) is shared by decodes and prefills, as
in vLLM's V1 scheduler: running sequences go first (one token each for decodes, the next
chunk for a prompt still being prefilled), then waiting sequences are admitted FCFS while
the budget, `max_num_seqs` and free KV blocks allow. A prompt longer than the remaining
budget is split (chunked prefill), so it shares steps with running decodes instead of
stalling them. When blocks run out, the newest running sequence is preempted: its blocks
are freed and it goes back to the head of the queue to be recomputed later (its full blocks
are often still in the prefix cache, which makes the recompute cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stoker.core.block_manager import BlockManager
from stoker.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [start_pos, start_pos + num_tokens)."""

    seq: Sequence
    start_pos: int  # == seq.num_computed_tokens before the step
    num_tokens: int
    block_table: list[int]
    # Fixed at planning time: the chunk reaches the end of the known tokens, so its last
    # position is sampled (a middle chunk of a long prompt is not).
    do_sample: bool = field(init=False)

    def __post_init__(self) -> None:
        self.do_sample = self.start_pos + self.num_tokens == self.seq.num_tokens

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.tokens_slice(self.start_pos, self.context_len)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        # Multi-LoRA: at most this many distinct adapters among the running sequences (the
        # compute slots); a sequence whose adapter would be one more waits, the others go on.
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the newest is last
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if seq.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens, more than max_model_len "
                f"({self.max_model_len}); shorten the prompt or raise max_model_len"
            )
        if not self.enable_chunked_prefill and seq.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens, more than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with chunked prefill off"
            )
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark seq finished (or aborted) and release its blocks, wherever it is."""
        assert status.is_finished
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running sequences, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, bm.get_block_table(seq)))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: everything newer is gone too

        # 2. Waiting sequences, FCFS, unless this step had to preempt (memory is tight).
        loras = {s.lora_name for s in self.running if s.lora_name is not None}
        no_slot: list[Sequence] = []  # waiting for a LoRA slot: passed over, kept in order
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (self.max_loras is not None and seq.lora_name is not None and seq.lora_name not in loras
                    and len(loras) >= self.max_loras):
                no_slot.append(self.waiting.popleft())
                continue
            if not self._leader_ready(seq):
                break
            # A cached block has K/V but no logits: prompt logprobs recompute the whole prompt.
            cached = [] if seq.wants_prompt_logprobs else bm.find_cached_prefix(seq)
            num_computed = seq.num_computed_tokens + len(cached) * bm.block_size
            remaining = seq.num_tokens - num_computed
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            bm.record_prefix_query(seq.num_tokens, len(cached) * bm.block_size)
            bm.allocate(seq, num_new, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, bm.get_block_table(seq)))
            budget -= num_new
            if seq.lora_name is not None:
                loras.add(seq.lora_name)
        self.waiting.extendleft(reversed(no_slot))

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step ran: the scheduled tokens are in the cache now."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            self.block_manager.cache_full_blocks(s.seq)

    # ------------------------------------------------------------------ internals
    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop seq's KV and queue it first in line."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _leader_ready(self, seq: Sequence) -> bool:
        """Siblings of an n > 1 request wait until the first has its prompt in the cache, so
        they take the prompt's full blocks from the prefix cache instead of recomputing them."""
        leader = seq.group_leader
        if leader is None or not self.block_manager.enable_prefix_caching or leader.is_finished:
            return True
        if leader.status is SequenceStatus.WAITING:
            return True  # the leader was preempted: waiting on it could stall the queue
        return leader.num_computed_tokens >= leader.num_prompt_tokens
