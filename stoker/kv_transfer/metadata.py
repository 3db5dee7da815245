"""What crosses between the connector's two sides each step, as plain values. [no torch]

Scheduler -> worker: `ConnectorMeta` in `StepMessage.kv_connector_meta` (the reads to start).
Worker -> scheduler: `StepResult.finished_sending` / `finished_recving` (vLLM's names) and a
`TransferReport` in `StepResult.kv_connector_output` (failed reads, each read's time and bytes).
Under tensor parallelism each rank reports its own `RankFinished`; rank 0 merges them
(aggregate.py) before the scheduler hears of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadSpec:
    """Read remote blocks into local ones: local_block_ids[i] <- remote_block_ids[i] in every
    layer's K (and V) cache."""

    request_id: str  # this engine's request id (finished_recving names it)
    remote_request_id: str  # the prefill engine's (its notification names it)
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ConnectorMeta:
    loads: tuple[LoadSpec, ...] = ()


@dataclass
class TransferReport:
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> why its read failed
    transfers: dict[str, tuple[float, int]] = field(default_factory=dict)  # request id -> (seconds, bytes) of its read

    def __bool__(self) -> bool:
        return bool(self.failed_recving or self.transfers)


@dataclass(frozen=True)
class RankFinished:
    """What one rank's worker side saw end since its last report: request ids whose leased
    blocks its reader is done with (sending), whose reads into this rank's heads arrived
    (recving), and the failed reads' reasons and finished reads' figures (report)."""

    sending: frozenset[str] = frozenset()
    recving: frozenset[str] = frozenset()
    report: TransferReport = field(default_factory=TransferReport)
