"""The NIXL connector's scheduler side: which requests wait for remote K/V, the reads to start,
and the blocks leased to remote readers. [no torch]

Decode engine (the reader): a request whose kv_transfer_params say do_remote_prefill takes its
local prefix-cache hit (and, with a host KV tier, the host hit past it: core/host_kv_pool.py),
gets fresh blocks for the rest of its prompt and waits in
WAITING_FOR_REMOTE_KV (outside the scheduler's queues, so it is never scheduled) while the
worker side READs the prefill engine's blocks into them. When the read arrives the prompt is
computed but its last token, which the first decode step recomputes to get logits (as vLLM
does). A failed read is recomputed locally (kv_load_failure_policy "recompute") or fails the
request ("fail"); either way the blocks it held before the read (the device hit and the blocks
loaded from the host tier) stay in the prefix cache, so a recompute starts past them.

Prefill engine (the holder): a request sent with do_remote_decode finishes after its one token
but keeps its blocks under a lease; the reader's notification (finished_sending) or the
lease's expiry (counted: vllm:nixl_num_kv_expired_reqs) frees them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stoker.core.block_manager import BlockManager
from stoker.core.sequence import Sequence, SequenceStatus
from stoker.kv_transfer import params as kv_params
from stoker.kv_transfer.base import KVConnectorScheduler
from stoker.kv_transfer.config import KVTransferConfig
from stoker.kv_transfer.metadata import ConnectorMeta, LoadSpec, TransferReport
from stoker.kv_transfer.stats import KVTransferStats

if TYPE_CHECKING:
    from stoker.core.scheduler import Scheduler
    from stoker.core.step import StepResult

logger = logging.getLogger(__name__)


@dataclass
class _Waiting:
    seq: Sequence
    spec: LoadSpec
    num_local_blocks: int  # its first blocks, not read: the device prefix hit, then the host tier's
    aborted: bool = False  # aborted while its read writes into its blocks: freed when the read ends


@dataclass
class _Lease:
    seq: Sequence
    deadline: float
    num_blocks: int


class NixlSchedulerConnector(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_manager: BlockManager, tp_size: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.bm = block_manager
        self.tp_size = tp_size
        self.clock = clock
        self.waiting_for_remote: dict[int, _Waiting] = {}  # seq_id ->
        self.leases: dict[str, _Lease] = {}  # the prefill engine's request id ->
        self.stats = KVTransferStats()
        self._to_load: list[LoadSpec] = []
        self._local: set[int] = set()  # seq ids that computed (or will compute) their prompt here
        self._params_out: dict[str, dict[str, Any]] = {}  # request id -> its response's kv_transfer_params
        self._failed: dict[str, str] = {}  # request id -> why (policy "fail")

    # ------------------------------------------------------------------ admission (decode engine)
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        if (seq.seq_id in self._local or seq.num_output_tokens or seq.wants_prompt_logprobs
                or not self.config.is_consumer):  # a kv_producer reads nothing: it computes the prompt
            return 0, False
        spec = kv_params.remote_prefill(seq.sampling_params.kv_transfer_params)
        if spec is None:
            return 0, False
        num_prompt = seq.num_prompt_tokens
        needed = self.bm.num_blocks_needed(num_prompt)
        if len(spec.remote_block_ids) != needed:
            # Another prompt than the prefill computed, or another block size: compute it here.
            logger.warning("request %s: %d remote blocks for a prompt of %d tokens (%d blocks); computing it locally",
                           seq.request_id, len(spec.remote_block_ids), num_prompt, needed)
            self._local.add(seq.seq_id)
            self.stats.num_failed_transfers += 1
            return 0, False
        count = num_prompt - num_computed_tokens
        self.stats.external_prefix_cache_queries += count
        self.stats.external_prefix_cache_hits += count
        return count, count > 0

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_local_blocks: int) -> None:
        spec = kv_params.remote_prefill(seq.sampling_params.kv_transfer_params)
        assert spec is not None
        load = LoadSpec(seq.request_id, spec.remote_request_id or seq.request_id, spec.remote_engine_id,
                        spec.remote_host, spec.remote_port, tuple(spec.remote_block_ids[num_local_blocks:]),
                        tuple(block_ids[num_local_blocks:]))
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote[seq.seq_id] = _Waiting(seq, load, num_local_blocks)
        self._to_load.append(load)

    def build_connector_meta(self) -> ConnectorMeta | None:
        if not self._to_load:
            return None
        meta = ConnectorMeta(tuple(self._to_load))
        self._to_load = []
        return meta

    # ------------------------------------------------------------------ finish
    def request_finished(self, seq: Sequence) -> bool:
        waiting = self.waiting_for_remote.get(seq.seq_id)
        if waiting is not None:
            if waiting.spec in self._to_load:  # its read never started: nothing writes into its blocks
                self._to_load.remove(waiting.spec)
                del self.waiting_for_remote[seq.seq_id]
                return False
            waiting.aborted = True
            return True
        self._local.discard(seq.seq_id)
        p = seq.sampling_params.kv_transfer_params
        if (not kv_params.wants_remote_decode(p) or seq.status is SequenceStatus.FINISHED_ABORTED
                or not self.config.is_producer):
            return False
        table = self.bm.get_block_table(seq)
        num_blocks = min(self.bm.num_blocks_needed(seq.num_prompt_tokens), len(table))
        if num_blocks == 0:
            return False
        lease = _Lease(seq, self.clock() + self.config.lease_duration_s, len(table))
        self.leases[seq.request_id] = lease
        self.stats.num_leased_blocks += lease.num_blocks
        self._params_out[seq.request_id] = kv_params.for_decode(
            seq.request_id, table[:num_blocks], self.config.engine_id, self.config.side_channel_host,
            self.config.side_channel_port, self.tp_size)
        return True

    def take_kv_transfer_params(self, request_id: str) -> dict[str, Any] | None:
        """The finished request's response params (the decode leg sends them back)."""
        return self._params_out.pop(request_id, None)

    def take_failed(self) -> dict[str, str]:
        """Requests whose read failed under kv_load_failure_policy "fail": the engine fails them."""
        failed, self._failed = self._failed, {}
        return failed

    def has_pending(self) -> bool:
        """Reads in flight or blocks leased: the engine keeps stepping (to hear of them) while idle."""
        return bool(self.waiting_for_remote or self.leases or self._to_load)

    # ------------------------------------------------------------------ results
    def update_after_step(self, scheduler: Scheduler, result: StepResult) -> None:
        report: TransferReport | None = getattr(result, "kv_connector_output", None)
        if report is not None:
            for seconds, num_bytes in report.transfers.values():
                self.stats.xfer_time_seconds.observe(seconds)
                self.stats.bytes_transferred.observe(num_bytes)
        for request_id in result.finished_sending:
            lease = self.leases.pop(request_id, None)
            if lease is not None:
                self._release(lease)
            else:  # its lease had expired: the blocks may have held another prompt by the time they were read
                logger.warning("request %s: a reader finished reading its KV blocks after their lease expired "
                               "(raise kv_lease_duration / VLLM_NIXL_ABORT_REQUEST_TIMEOUT)", request_id)
        failed = report.failed_recving if report is not None else {}
        if result.finished_recving or failed:
            for w in list(self.waiting_for_remote.values()):
                if w.seq.request_id in result.finished_recving:
                    self._arrived(scheduler, w)
                elif w.seq.request_id in failed:
                    self._load_failed(scheduler, w, failed[w.seq.request_id])
        self.expire_leases()

    def expire_leases(self) -> None:
        now = self.clock()
        for request_id, lease in list(self.leases.items()):
            if lease.deadline <= now:
                logger.warning("request %s: no reader took its KV blocks within %.0f s (kv_lease_duration); freed",
                               request_id, self.config.lease_duration_s)
                del self.leases[request_id]
                self.stats.num_kv_expired_reqs += 1
                self._release(lease)

    # ------------------------------------------------------------------ internals
    def _release(self, lease: _Lease) -> None:
        self.bm.free(lease.seq)
        self.stats.num_leased_blocks -= lease.num_blocks

    def _arrived(self, scheduler: Scheduler, w: _Waiting) -> None:
        seq = w.seq
        del self.waiting_for_remote[seq.seq_id]
        self._local.add(seq.seq_id)  # a later recompute (preemption) computes here: the remote blocks are gone
        if w.aborted:
            self.bm.free(seq)
            return
        # The whole prompt's K/V is here; its last token is computed again for its logits.
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        seq.status = SequenceStatus.RUNNING
        scheduler.resume(seq)
        self.bm.cache_full_blocks(seq)

    def _load_failed(self, scheduler: Scheduler, w: _Waiting, reason: str) -> None:
        seq = w.seq
        del self.waiting_for_remote[seq.seq_id]
        self._local.add(seq.seq_id)
        self.stats.num_failed_transfers += 1
        # The blocks before the read hold valid K/V (the host tier's were loaded in the step that
        # admitted it, before the read started): hashed into the prefix cache, so a recompute takes
        # them as a device hit instead of loading or computing them again. The read's blocks are not.
        seq.num_computed_tokens = w.num_local_blocks * self.bm.block_size
        self.bm.cache_full_blocks(seq)
        self.bm.free(seq)
        if w.aborted:
            return
        if self.config.kv_load_failure_policy == "recompute":
            logger.warning("request %s: reading its KV from engine %s failed (%s); computing its prompt locally",
                           seq.request_id, w.spec.remote_engine_id, reason)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            seq.status = SequenceStatus.WAITING
            scheduler.requeue(seq)
        else:
            self._failed[seq.request_id] = (f"reading the prompt's KV cache from engine {w.spec.remote_engine_id} at "
                                            f"{w.spec.remote_host}:{w.spec.remote_port} failed: {reason} "
                                            "(kv_load_failure_policy is 'fail')")


def check_kv_transfer(config: Any) -> None:
    """Refuse what the connector does not do yet, before any worker starts."""
    kv = config.kv_transfer_config
    if kv is None:
        return
    if config.parallel_config.nnodes > 1:
        # every rank's side channel listens on the engine's side-channel host (port + rank): one node's
        raise ValueError("--kv-transfer-config with --nnodes > 1 is not supported yet (each rank's NIXL side "
                         "channel listens on the engine's side-channel host); serve each engine on one node")


def make_scheduler_connector(config: Any, block_manager: BlockManager) -> NixlSchedulerConnector | None:
    kv = config.kv_transfer_config
    if kv is None:
        return None
    return NixlSchedulerConnector(kv, block_manager, config.parallel_config.tensor_parallel_size)
