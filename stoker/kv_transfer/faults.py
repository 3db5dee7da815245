"""A transport that misbehaves on purpose, for tests: reads dropped, reads delayed,
notifications lost. Chosen with kv_connector_extra_config {"faults": {...}}:

  "drop_reads": true          every read ends in "ERR" without moving a byte
  "read_delay_s": 0.5         a read reports "PROC" this long after it really finished
  "lose_notifications": true  the peer is never told a read is done (its lease must expire)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from stoker.kv_transfer.transport import KVTransport, Region

_KNOWN = {"drop_reads", "read_delay_s", "lose_notifications"}


@dataclass
class _Handle:
    inner: Any
    ready_at: float


class FaultyTransport(KVTransport):
    def __init__(self, inner: KVTransport, faults: dict[str, Any]) -> None:
        unknown = sorted(set(faults) - _KNOWN)
        if unknown:
            raise ValueError(f"kv_connector_extra_config faults {', '.join(unknown)} are not known; known: "
                             f"{', '.join(sorted(_KNOWN))}")
        self.inner = inner
        self.name = inner.name
        self.drop_reads = bool(faults.get("drop_reads"))
        self.read_delay_s = float(faults.get("read_delay_s", 0.0))
        self.lose_notifications = bool(faults.get("lose_notifications"))

    def register(self, regions: list[Region], mem_type: str) -> None:
        self.inner.register(regions, mem_type)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def read(self, peer: str, local: list[Region], remote: list[Region], mem_type: str, notification: bytes) -> Any:
        if self.drop_reads:
            return _Handle(None, 0.0)
        note = b"" if self.lose_notifications else notification
        return _Handle(self.inner.read(peer, local, remote, mem_type, note), time.monotonic() + self.read_delay_s)

    def state(self, handle: Any) -> str:
        if handle.inner is None:
            return "ERR"
        state = self.inner.state(handle.inner)
        return "PROC" if state == "DONE" and time.monotonic() < handle.ready_at else state

    def release(self, handle: Any) -> None:
        if handle.inner is not None:
            self.inner.release(handle.inner)

    def notifications(self) -> list[bytes]:
        return self.inner.notifications()

    def close(self) -> None:
        self.inner.close()
