"""Continuous batching: which sequences run this step, and how many tokens of each. [no torch]

One token budget per step (`max_num_batched_tokens`) is shared by decodes and prefills, as
in vLLM's V1 scheduler: running sequences go first (one token each for decodes, the next
chunk for a prompt still being prefilled), then waiting sequences are admitted FCFS while
the budget, `max_num_seqs` and free KV blocks allow. A prompt longer than the remaining
budget is split (chunked prefill), so it shares steps with running decodes instead of
stalling them. When blocks run out, the newest running sequence is preempted: its blocks
are freed and it goes back to the head of the queue to be recomputed later (its full blocks
are often still in the prefix cache, which makes the recompute cheap).

Under the priority policy (vLLM's `--scheduling-policy priority`) both queues are kept in
(priority, arrival) order, lower priority values first: the waiting queue admits in that
order, running sequences take the budget in that order, and the preemption victim is the
last, so the least urgent sequence is recomputed. A waiting request does not preempt a running
one to get in: it is admitted first when blocks are free again.

The scheduler learns from each step (DESIGN.md, seam 21): `schedule()` plans and reserves the
blocks, the runner answers a `StepResult`, and `update_after_step(plan, result)` advances each
sequence by what was computed and accepted, appends the accepted tokens, frees the blocks
that hold only rejected draft tokens and registers the full blocks in the prefix cache. Draft
tokens (`Sequence.draft_token_ids`, speculative decoding) are scheduled after a running
sequence's known tokens; the K/V of a rejected draft is never hashed and its block is freed.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stoker.core.block_manager import BlockManager
from stoker.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from stoker.core.host_kv_pool import HostKVPool
    from stoker.core.step import StepResult


@dataclass(slots=True)  # one per scheduled sequence per step
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [start_pos, start_pos + num_tokens), the
    last `num_draft_tokens` of them proposed drafts to verify."""

    seq: Sequence
    start_pos: int  # == seq.num_computed_tokens before the step
    num_tokens: int
    block_table: list[int]
    num_draft_tokens: int = 0
    # Fixed at planning time: the chunk reaches the end of the known tokens, so its last
    # known position is sampled (a middle chunk of a long prompt is not), and so is each draft's.
    do_sample: bool = field(init=False)

    def __post_init__(self) -> None:
        seq = self.seq
        self.do_sample = (self.start_pos + self.num_tokens - self.num_draft_tokens
                          == len(seq.prompt_token_ids) + len(seq.output_token_ids))

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens

    @property
    def draft_token_ids(self) -> list[int]:
        return self.seq.draft_token_ids[: self.num_draft_tokens]

    @property
    def token_ids(self) -> list[int]:
        known = self.seq.tokens_slice(self.start_pos, self.context_len - self.num_draft_tokens)
        return known + self.draft_token_ids if self.num_draft_tokens else known


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    # (source, destination) block copies the runner makes before the forward (StepMessage.kv_copies)
    kv_copies: list[tuple[int, int]] = field(default_factory=list)
    # Host KV tier (core/host_kv_pool.py): (device block, host slot) saves, then (host slot, device
    # block) loads, made before the forward (StepMessage.kv_host_saves / kv_host_loads)
    kv_host_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_host_loads: list[tuple[int, int]] = field(default_factory=list)

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
        policy: str = "fcfs",
    ) -> None:
        self.block_manager = block_manager
        self.by_priority = policy == "priority"
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
        # A KV connector's scheduler side (stoker/kv_transfer/scheduler_side.py), set by the engine
        self.kv_connector: Any = None
        self.host_kv: HostKVPool | None = None  # the host KV tier (--kv-offloading-size), set by the engine

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        # The input processor (engine/input_processor.py) admits only prompts that can run; these
        # say the invariants the scheduler relies on (a prompt it could never place would hang).
        assert 0 < seq.num_prompt_tokens <= self.max_model_len, (seq.num_prompt_tokens, self.max_model_len)
        assert self.enable_chunked_prefill or seq.num_prompt_tokens <= self.max_num_batched_tokens
        if self.by_priority:
            self._insert_sorted(self.waiting, seq)
        else:
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
        if self.kv_connector is not None and self.kv_connector.request_finished(seq):
            return  # its blocks outlive it: a remote reader's lease, or a read still writing into them
        self.block_manager.free(seq)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        if self.host_kv is not None:
            self.host_kv.begin_step()

        # 1. Running sequences, oldest first; preempt the newest when blocks run out.
        i = 0
        running = self.running
        scheduled = out.scheduled
        held_table_if_room = bm.held_table_if_room
        while i < len(running) and budget > 0:
            seq = running[i]
            num_uncomputed = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
            num_new = min(num_uncomputed + len(seq.draft_token_ids), budget)
            table = held_table_if_room(seq, num_new)
            if table is not None:  # its blocks have room: nothing to allocate (most decode steps)
                scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, table,
                                                   max(num_new - num_uncomputed, 0)))
                budget -= num_new
                i += 1
                continue
            if num_new > num_uncomputed and not bm.can_allocate(seq, num_new):
                # Drafts are a bet: never preempt a sequence (a recompute) to make room for them.
                num_new = min(num_uncomputed, budget)
            while not bm.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                num_drafts = max(num_new - num_uncomputed, 0)  # the budget may cut drafts
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, bm.get_block_table(seq),
                                                       num_drafts))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: everything newer is gone too

        # 2. Waiting sequences, FCFS, unless this step had to preempt (memory is tight).
        if not self.waiting:  # nothing to admit (most steps of a full batch): no pass over the running ones
            return self._finish_plan(out, budget)
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
            # Host KV tier: the blocks past the device hit that host memory holds are loaded, not computed
            host_slots = (self.host_kv.find(seq, cached, bm)
                          if self.host_kv is not None and not seq.wants_prompt_logprobs else [])
            num_loaded = len(host_slots) * bm.block_size
            num_computed = seq.num_computed_tokens + len(cached) * bm.block_size + num_loaded
            remaining = seq.num_tokens - num_computed
            if self.kv_connector is not None:  # the rest of its prompt may come from a remote engine
                admitted = self._admit_remote(seq, cached, host_slots, num_computed, out)
                if admitted is not None:
                    if admitted:
                        continue
                    break  # no blocks for its read yet: it stays first in line
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq, num_loaded + num_new, cached):
                break
            self.waiting.popleft()
            bm.record_prefix_query(seq.num_tokens, len(cached) * bm.block_size)
            if self.host_kv is not None:  # allocates, and plans the loads of the host hits
                self.host_kv.admit(seq, num_new, cached, host_slots, bm, out.kv_host_loads)
            else:
                bm.allocate(seq, num_new, cached)
            seq.status = SequenceStatus.RUNNING
            if self.by_priority:
                self._insert_sorted(self.running, seq)
            else:
                self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, bm.get_block_table(seq)))
            budget -= num_new
            if seq.lora_name is not None:
                loras.add(seq.lora_name)
        self.waiting.extendleft(reversed(no_slot))
        return self._finish_plan(out, budget)

    def _finish_plan(self, out: SchedulerOutput, budget: int) -> SchedulerOutput:
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if self.host_kv is not None:
            out.kv_host_saves = self.host_kv.take_saves()
        return out

    def update_after_step(self, plan: SchedulerOutput, result: StepResult) -> None:
        """The step ran: advance each scheduled sequence by what it computed and accepted.

        A sequence that sampled gets its accepted tokens appended. Its K/V is valid for the known
        tokens it computed and for the drafts that were accepted (the accepted tokens but the
        last, which is new); a rejected draft's position is not computed, so the sequence rolls
        back to before it, the blocks holding only rejected drafts are freed, and only blocks
        full of computed tokens are hashed into the prefix cache."""
        if self.kv_connector is not None:  # reads arrived or failed, leases ended (stoker/kv_transfer/)
            self.kv_connector.update_after_step(self, result)
        elif result.finished_sending or result.finished_recving:
            raise RuntimeError("a KV connector reported finished transfers, but this scheduler runs none")
        bm = self.block_manager
        # Every scheduled sequence is still live: nothing finishes one between its plan and its result.
        for s in plan.scheduled:
            seq = s.seq
            num_computed = s.num_tokens - s.num_draft_tokens
            sampled = result.sampled.get(seq.seq_id)
            if s.do_sample:
                if sampled is None or not 1 <= len(sampled.token_ids) <= 1 + s.num_draft_tokens:
                    got = "none" if sampled is None else len(sampled.token_ids)
                    raise RuntimeError(f"sequence {seq.seq_id} sampled {1 + s.num_draft_tokens} row(s) but the step "
                                       f"accepted {got} token(s): a runner must accept 1 to 1 + drafts")
                accepted = sampled.token_ids
                num_computed += len(accepted) - 1  # the accepted drafts; the last token is new
                seq.output_token_ids.extend(accepted)  # seq.append_tokens, inlined (every sequence, every step)
            seq.num_computed_tokens = s.start_pos + num_computed
            if seq.draft_token_ids:  # verified, or cut by the budget: stale once a token is appended
                seq.draft_token_ids = []
            if s.num_draft_tokens:
                bm.free_tail(seq)
            bm.cache_full_blocks(seq)
        if self.host_kv is not None:
            self.host_kv.end_step()  # the step's host copies ran: its saves may be loaded, its slots reused

    # ------------------------------------------------------------------ KV connector
    def _admit_remote(self, seq: Sequence, cached: list[int], host_slots: list[int], num_computed: int,
                      out: SchedulerOutput) -> bool | None:
        """Admit seq to wait for its prompt's remote K/V (blocks for the whole prompt, no
        budget: no step computes them). None when it computes locally; False when its
        blocks do not fit yet.

        Claims in order, each block once: the device prefix hit `cached` (shared blocks), then
        the host tier's hit `host_slots` (fresh blocks loaded from host memory this step), then
        the remote engine for the rest (`num_computed` counts the first two, so the connector
        claims only the blocks past them and its read fills only those)."""
        num_external, load_async = self.kv_connector.get_num_new_matched_tokens(seq, num_computed)
        if not load_async:
            return None
        bm = self.block_manager
        num_loaded = len(host_slots) * bm.block_size
        if not bm.can_allocate(seq, num_loaded + num_external, cached):
            return False
        self.waiting.popleft()
        bm.record_prefix_query(seq.num_tokens, len(cached) * bm.block_size)
        if self.host_kv is not None:  # allocates, and plans the loads of the host hits (before the read starts)
            self.host_kv.admit(seq, num_external, cached, host_slots, bm, out.kv_host_loads)
        else:
            bm.allocate(seq, num_external, cached)
        self.kv_connector.update_state_after_alloc(seq, bm.get_block_table(seq), len(cached) + len(host_slots))
        return True

    def resume(self, seq: Sequence) -> None:
        """seq's remote K/V arrived: it runs from the next step."""
        if self.by_priority:
            self._insert_sorted(self.running, seq)
        else:
            self.running.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """seq computes its prompt here after all (its remote read failed): first in line."""
        if self.by_priority:
            self._insert_sorted(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ internals
    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop seq's KV and queue it first in line."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._insert_sorted(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)

    @staticmethod
    def _insert_sorted(queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
        """Into (priority, arrival) order, after its equals (FIFO among them). O(n): queues
        are at most max_num_seqs running and the waiting requests."""
        key = (seq.priority, seq.arrival_time)
        i = bisect.bisect_right([(s.priority, s.arrival_time) for s in queue], key)
        queue.insert(i, seq)

    def _leader_ready(self, seq: Sequence) -> bool:
        """Siblings of an n > 1 request wait until the first has its prompt in the cache, so
        they take the prompt's full blocks from the prefix cache instead of recomputing them."""
        leader = seq.group_leader
        if leader is None or not self.block_manager.enable_prefix_caching or leader.is_finished:
            return True
        if leader.status is SequenceStatus.WAITING:
            return True  # the leader was preempted: waiting on it could stall the queue
        return leader.num_computed_tokens >= leader.num_prompt_tokens
