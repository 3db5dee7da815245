"""The bytes mover under the worker side: a small interface, NIXL behind it.

`KVTransport` is what the worker side needs of a transport: register its cache regions,
describe itself to peers, READ lists of (address, length) regions of a peer into its own with
a notification to the peer when done, poll, and collect notifications. `NixlTransport` is
NIXL over UCX (host memory here; on loopback set UCX_NET_DEVICES=lo); faults.py wraps any
transport to drop, delay or lose.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

logger = logging.getLogger(__name__)

Region = tuple[int, int]  # (address, bytes)


class KVTransport(ABC):
    name: str

    @abstractmethod
    def register(self, regions: list[Region], mem_type: str) -> None: ...

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this transport (NIXL: the agent metadata)."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Make a peer known; returns its name."""

    @abstractmethod
    def read(self, peer: str, local: list[Region], remote: list[Region], mem_type: str, notification: bytes) -> Any:
        """Start reading remote[i] into local[i]; the peer is told `notification` when done.
        Returns a handle for `state`."""

    @abstractmethod
    def state(self, handle: Any) -> str:
        """"DONE", "PROC" (in progress) or "ERR"."""

    @abstractmethod
    def release(self, handle: Any) -> None: ...

    @abstractmethod
    def notifications(self) -> list[bytes]:
        """Notifications peers sent since the last call."""

    def close(self) -> None:
        pass


class NixlTransport(KVTransport):
    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise ImportError(f"the NixlConnector needs the nixl package ({exc}); install it with "
                              "`pip install nixl` (after torch, whose version it must not replace)") from None
        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self._registered: list[Any] = []

    def register(self, regions: list[Region], mem_type: str) -> None:
        self._registered.append(self.agent.register_memory([(a, n, 0, "") for a, n in regions], mem_type))

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def read(self, peer: str, local: list[Region], remote: list[Region], mem_type: str, notification: bytes) -> Any:
        local_descs = self.agent.get_xfer_descs([(a, n, 0) for a, n in local], mem_type)
        remote_descs = self.agent.get_xfer_descs([(a, n, 0) for a, n in remote], mem_type)
        handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, peer, notification)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL could not post the read from {peer}")
        return handle

    def state(self, handle: Any) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)

    def notifications(self) -> list[bytes]:
        return [msg for msgs in self.agent.get_new_notifs().values() for msg in msgs]

    def close(self) -> None:
        for descs in self._registered:
            try:
                self.agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001 - closing: nothing to do about it
                logger.debug("NIXL deregister failed", exc_info=True)
        self._registered = []
