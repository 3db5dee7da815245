"""Rank 0's view of a tensor-parallel engine's KV transfers. [no torch]

With TP = N each rank's worker side registers its own KV heads with its own NIXL agent, and
each rank of a decode engine reads the same rank's heads of the prefill engine (equal TP on
both sides, as vLLM's NixlConnector with equal TP). A request's read therefore ends N times,
once per rank, possibly in different steps; so does the prefill side's lease (one
notification per reading rank). The scheduler must hear of either once, when all N parts
are over: a read is done when every rank's part arrived, failed when any part failed (but
only once every part has ended, since a rank still reading writes into the blocks), and a
lease ends when every rank's reader has notified.

Every rank ends every read it was given (arrived, failed, or timed out after load_timeout_s), so
no read stays here. A lease that expired with only some reader ranks notified leaves its count
here (a request id and an int) until the others notify, if ever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stoker.kv_transfer.metadata import RankFinished, TransferReport

if TYPE_CHECKING:
    from stoker.core.step import StepResult


@dataclass
class _Read:
    ranks_done: int = 0
    seconds: float = 0.0  # the slowest rank's part: the request waits for all of them
    num_bytes: int = 0  # every rank's part
    failed: str | None = None


@dataclass
class FinishedAggregator:
    world_size: int
    _reads: dict[str, _Read] = field(default_factory=dict)  # request id -> its ranks' parts so far
    _notified: dict[str, int] = field(default_factory=dict)  # request id -> ranks whose reader notified

    def merge(self, parts: list[RankFinished]) -> RankFinished:
        """One step's reports, one per rank, in: what ended on every rank so far, out."""
        assert len(parts) == self.world_size, (len(parts), self.world_size)
        sending: set[str] = set()
        recving: set[str] = set()
        report = TransferReport()
        for rank, part in enumerate(parts):
            for request_id in part.sending:
                n = self._notified.get(request_id, 0) + 1
                if n == self.world_size:
                    del self._notified[request_id]
                    sending.add(request_id)
                else:
                    self._notified[request_id] = n
            ended = set(part.recving) | set(part.report.failed_recving)
            for request_id in ended:
                read = self._reads.setdefault(request_id, _Read())
                read.ranks_done += 1
                if request_id in part.report.failed_recving:
                    read.failed = read.failed or f"rank {rank}: {part.report.failed_recving[request_id]}"
                elif request_id in part.report.transfers:
                    seconds, num_bytes = part.report.transfers[request_id]
                    read.seconds = max(read.seconds, seconds)
                    read.num_bytes += num_bytes
                if read.ranks_done < self.world_size:
                    continue
                del self._reads[request_id]
                if read.failed is not None:
                    report.failed_recving[request_id] = read.failed
                else:
                    recving.add(request_id)
                    report.transfers[request_id] = (read.seconds, read.num_bytes)
        return RankFinished(frozenset(sending), frozenset(recving), report)

    def pending(self) -> int:
        """Requests some but not all ranks have reported (reads, then leases)."""
        return len(self._reads) + len(self._notified)


def with_finished(result: StepResult, finished: RankFinished) -> StepResult:
    """The step's result carrying what ended (vLLM's finished_sending / finished_recving)."""
    result.finished_sending, result.finished_recving = finished.sending, finished.recving
    if finished.report:
        result.kv_connector_output = finished.report
    return result
