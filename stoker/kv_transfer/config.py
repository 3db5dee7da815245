"""`--kv-transfer-config` / `LLM(kv_transfer_config=...)`: vLLM's KVTransferConfig keys. [no torch]

{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
 "engine_id": "...", "kv_connector_extra_config": {...}}. A key or value this engine does not
read is refused by name, never ignored.

The side channel (the handshake a decode engine opens to the prefill engine whose blocks it
reads) listens on STOKER_NIXL_SIDE_CHANNEL_HOST:STOKER_NIXL_SIDE_CHANNEL_PORT (vLLM's
VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT are read too; defaults localhost:5600, vLLM's); the
extra config's "side_channel_host" / "side_channel_port" override them per engine (two engines
in one process). Blocks handed to a reader are leased for "kv_lease_duration" seconds (else
VLLM_NIXL_ABORT_REQUEST_TIMEOUT, default 480 as vLLM's), then freed and counted as expired.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
_KEYS = {"kv_connector", "kv_role", "kv_load_failure_policy", "engine_id", "kv_connector_extra_config", "kv_buffer_device"}
# extra config keys read here; "faults" injects transport faults (stoker/kv_transfer/faults.py), for tests
_EXTRA_KEYS = {"side_channel_host", "side_channel_port", "kv_lease_duration", "load_timeout_s", "faults", "backends"}


def _env(*names: str, default: str) -> str:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return default


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_buffer_device: str = "cpu"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector {self.kv_connector!r} is not supported; "
                             f"supported: {', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config kv_load_failure_policy must be one of "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        if self.kv_buffer_device not in ("cpu", "cuda"):
            raise ValueError(f"kv_transfer_config kv_buffer_device must be cpu or cuda, got {self.kv_buffer_device!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(self.kv_connector_extra_config) - _EXTRA_KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config keys {', '.join(unknown)} are not supported; "
                             f"supported: {', '.join(sorted(_EXTRA_KEYS))}")
        port = self.side_channel_port
        if not 0 < port < 65536:
            raise ValueError(f"the NIXL side-channel port must be in [1, 65535], got {port}")
        if self.lease_duration_s <= 0 or self.load_timeout_s <= 0:
            raise ValueError("kv_lease_duration and load_timeout_s must be positive seconds")

    @classmethod
    def from_dict(cls, values: Any) -> KVTransferConfig:
        if isinstance(values, str):
            try:
                values = json.loads(values)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not JSON ({exc}): {values!r}") from None
        if not isinstance(values, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object (dict), got {type(values).__name__}")
        unknown = sorted(set(values) - _KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config keys {', '.join(unknown)} are not supported; "
                             f"supported keys: {', '.join(sorted(_KEYS))}")
        if "kv_connector" not in values:
            raise ValueError('kv_transfer_config needs "kv_connector" (supported: ' + ", ".join(KV_CONNECTORS) + ")")
        return cls(**values)

    # ------------------------------------------------------------------ derived
    @property
    def side_channel_host(self) -> str:
        return str(self.kv_connector_extra_config.get("side_channel_host") or
                   _env("STOKER_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST", default="localhost"))

    @property
    def side_channel_port(self) -> int:
        value = self.kv_connector_extra_config.get("side_channel_port") or \
            _env("STOKER_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT", default="5600")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"the NIXL side-channel port must be an integer, got {value!r}") from None

    @property
    def lease_duration_s(self) -> float:
        value = self.kv_connector_extra_config.get("kv_lease_duration")
        return float(value if value is not None else _env("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", default="480"))

    @property
    def load_timeout_s(self) -> float:
        """How long a decode engine waits for a read before it counts as failed."""
        return float(self.kv_connector_extra_config.get("load_timeout_s", 30.0))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
