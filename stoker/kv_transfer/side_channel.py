"""The handshake side channel: a prefill engine answers, on a small TCP port, what a reader
needs to READ its blocks. [no torch]

One JSON line each way. The reader sends {"engine_id": ...}; the holder answers
{"engine_id", "agent_metadata" (base64 of NIXL's agent metadata), "layout" ({"regions":
[[base address, bytes per block], ...] one per registered cache tensor, "num_blocks"}),
"compat" (compat.FIELDS), "compat_hash"}. Port: STOKER_NIXL_SIDE_CHANNEL_PORT (or
VLLM_NIXL_SIDE_CHANNEL_PORT), as the engine's KVTransferConfig resolves it.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
_MAX_LINE = 1 << 24  # agent metadata is a few KiB; a layout one pair per layer


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class SideChannelServer:
    """Answers handshakes from a daemon thread until `close()`."""

    def __init__(self, host: str, port: int, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    request = json.loads(self.rfile.readline(_MAX_LINE) or b"{}")
                    reply = answer(request)
                except Exception as exc:  # noqa: BLE001 - the reader gets the reason, the server lives on
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        try:
            self._server = _Server((host, port), Handler)
        except OSError as exc:
            raise OSError(f"the NIXL side channel cannot listen on {host}:{port} ({exc}); set "
                          "STOKER_NIXL_SIDE_CHANNEL_PORT (or VLLM_NIXL_SIDE_CHANNEL_PORT) to a free port") from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="nixl-side-channel", daemon=True)
        self._thread.start()
        logger.info("NIXL side channel listening on %s:%d", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def handshake(host: str, port: int, request: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """The holder's answer; OSError when it cannot be reached, ValueError when it refuses."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(json.dumps(request).encode() + b"\n")
        with sock.makefile("rb") as f:
            line = f.readline(_MAX_LINE)
    if not line:
        raise OSError(f"the NIXL side channel at {host}:{port} closed without answering")
    reply = json.loads(line)
    if "error" in reply:
        raise ValueError(f"the engine at {host}:{port} refused the handshake: {reply['error']}")
    return reply
