"""A request's `kv_transfer_params`, with vLLM's keys and wire behaviour. [no torch]

Prefill leg (sent with max_tokens 1): {"do_remote_decode": true}. Its response carries
{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [...],
 "remote_engine_id": ..., "remote_host": ..., "remote_port": ..., "tp_size": ...}, which the
decode leg sends back unchanged beside the original request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_KNOWN = {"do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_host",
          "remote_port", "tp_size", "remote_request_id"}


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's prompt K/V lives: the prefill engine and its block ids."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[int, ...]
    tp_size: int
    remote_request_id: str | None  # the prefill engine's id for it (the notification names it)


def check(params: Any) -> dict[str, Any]:
    """The params as given, or ValueError saying which key is wrong (the server's 400)."""
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise ValueError(f"kv_transfer_params keys {', '.join(unknown)} are not known; vLLM's keys are "
                         f"{', '.join(sorted(_KNOWN))}")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if params.get("do_remote_prefill"):
        remote_prefill(params)
    return params


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The decode leg's source, or None when the request is not one."""
    if not params or not params.get("do_remote_prefill"):
        return None
    missing = [k for k in ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port") if params.get(k) is None]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)} (the prefill "
                         "response's kv_transfer_params, sent back unchanged)")
    ids = params["remote_block_ids"]
    if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise ValueError("kv_transfer_params remote_block_ids must be a list of non-negative block ids")
    port = params["remote_port"]
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params remote_port must be a port number, got {port!r}")
    tp = params.get("tp_size", 1)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"kv_transfer_params tp_size must be a positive integer, got {tp!r}")
    rid = params.get("remote_request_id")
    return RemotePrefill(str(params["remote_engine_id"]), str(params["remote_host"]), port, tuple(ids), tp,
                         None if rid is None else str(rid))


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def for_decode(request_id: str, block_ids: list[int], engine_id: str, host: str, port: int, tp_size: int) -> dict[str, Any]:
    """What the prefill leg's response carries (vLLM's NixlConnector.request_finished)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(block_ids),
            "remote_engine_id": engine_id, "remote_host": host, "remote_port": port, "tp_size": tp_size,
            "remote_request_id": request_id}
