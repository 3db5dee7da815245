"""What crosses between the connector's two sides each step, as plain values. [no torch]

Scheduler -> worker: `ConnectorMeta` in `StepMessage.kv_connector_meta` (the reads to start).
Worker -> scheduler: `StepResult.finished_sending` / `finished_recving` (vLLM's names) and a
`TransferReport` in `StepResult.kv_connector_output` (failed reads, each read's time and bytes).
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
    transfers: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes) per finished read

    def __bool__(self) -> bool:
        return bool(self.failed_recving or self.transfers)
