"""vLLM's spellings of a host KV tier inside `--kv-transfer-config`, read into Stoker's two settings. [no torch]

    resolve(values) -> (KVTransferConfig | None, host tier GiB | None)

Accepted, as vLLM writes them:
  {"kv_connector": "NixlConnector", ...}                       the NIXL connector alone (config.py)
  {"kv_connector": "OffloadingConnector",
   "kv_connector_extra_config": {"cpu_bytes_to_use": BYTES}}   the host tier alone (= --kv-offloading-size)
  {"kv_connector": "MultiConnector", "kv_role": "kv_both",
   "kv_connector_extra_config": {"connectors": [
       {"kv_connector": "NixlConnector", ...},
       {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": BYTES}}]}}   both (llm-d's P/D + offload setup)

The host tier is Stoker's own (core/host_kv_pool.py), not a connector object: "cpu_bytes_to_use"
becomes kv_offloading_size (GiB, all ranks together, vLLM's meaning). Whatever the list order,
the claims at admission are the same (docs/kv_offloading.md): the device prefix hit, then the host
tier's hit, then the NIXL read for the blocks past both. vLLM's MultiConnector instead lets the
first child that claims tokens load them all, so [Nixl, Offloading] would read the host-held
blocks over the network too, and [Offloading, Nixl] would compute the rest instead of reading it.
A child may name "engine_id"; else it takes the MultiConnector's, as in vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from stoker.kv_transfer.config import KVTransferConfig

OFFLOADING = "OffloadingConnector"
MULTI = "MultiConnector"
_MULTI_KEYS = {"kv_connector", "kv_role", "engine_id", "kv_connector_extra_config"}
_OFFLOADING_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config"}


def _load(values: Any) -> dict[str, Any]:
    if isinstance(values, str):
        try:
            values = json.loads(values)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_transfer_config is not JSON ({exc}): {values!r}") from None
    if not isinstance(values, dict):
        raise ValueError(f"kv_transfer_config must be a JSON object (dict), got {type(values).__name__}")
    return values


def _unknown(values: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where} keys {', '.join(unknown)} are not supported; supported: {', '.join(sorted(known))}")


def _offloading_gib(values: dict[str, Any], where: str) -> float:
    _unknown(values, _OFFLOADING_KEYS, where)
    if values.get("kv_role", "kv_both") != "kv_both":
        raise ValueError(f"{where} kv_role must be kv_both (the host tier both saves and loads), got {values['kv_role']!r}")
    extra = values.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{where} kv_connector_extra_config must be a JSON object")
    _unknown(extra, {"cpu_bytes_to_use"}, f"{where} kv_connector_extra_config")
    size = extra.get("cpu_bytes_to_use")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"{where} needs kv_connector_extra_config.cpu_bytes_to_use, the host tier's bytes "
                         f"(all ranks together; vLLM's --kv-offloading-size in bytes), got {size!r}")
    return float(size) / (1 << 30)


def resolve(values: Any) -> tuple[KVTransferConfig | None, float | None]:
    """(the NIXL connector's config or None, the host tier's GiB or None) from vLLM's JSON."""
    values = _load(values)
    connector = values.get("kv_connector")
    if connector == OFFLOADING:
        return None, _offloading_gib(values, "kv_transfer_config")
    if connector != MULTI:
        return KVTransferConfig.from_dict(values), None
    _unknown(values, _MULTI_KEYS, "kv_transfer_config (MultiConnector)")
    if values.get("kv_role", "kv_both") != "kv_both":
        raise ValueError(f"MultiConnector kv_role must be kv_both (each child's kv_role says what it does), "
                         f"got {values['kv_role']!r}")
    children = (values.get("kv_connector_extra_config") or {}).get("connectors")
    extra_keys = set(values.get("kv_connector_extra_config") or {}) - {"connectors"}
    if extra_keys:
        raise ValueError(f"MultiConnector kv_connector_extra_config keys {', '.join(sorted(extra_keys))} are not "
                         "supported; supported: connectors")
    if not isinstance(children, list) or not children or not all(isinstance(c, dict) for c in children):
        raise ValueError('MultiConnector needs kv_connector_extra_config.connectors: a list of connector configs '
                         '(NixlConnector and/or OffloadingConnector)')
    names = [c.get("kv_connector") for c in children]
    for name in names:
        if name not in ("NixlConnector", OFFLOADING):
            raise ValueError(f"MultiConnector connector {name!r} is not supported; supported: NixlConnector, "
                             f"{OFFLOADING}")
    if len(set(names)) != len(names):
        raise ValueError(f"MultiConnector lists a connector twice ({', '.join(map(str, names))}); one NixlConnector "
                         f"and one {OFFLOADING} at most")
    nixl: KVTransferConfig | None = None
    gib: float | None = None
    for child in children:
        if child["kv_connector"] == OFFLOADING:
            gib = _offloading_gib(child, f"MultiConnector's {OFFLOADING}")
        else:
            inherited = {"engine_id": values["engine_id"]} if "engine_id" in values else {}
            nixl = KVTransferConfig.from_dict({**inherited, **child})
    return nixl, gib


def merge_offloading_size(flag_gib: float | None, config_gib: float | None) -> float | None:
    """--kv-offloading-size and an OffloadingConnector's cpu_bytes_to_use name one host tier: once."""
    if flag_gib is not None and config_gib is not None and abs(flag_gib - config_gib) > 1e-9 * max(flag_gib, 1.0):
        raise ValueError(f"the host KV tier's size is given twice: kv_offloading_size {flag_gib:g} GiB and "
                         f"kv_transfer_config's OffloadingConnector cpu_bytes_to_use ({config_gib:g} GiB); give one")
    return config_gib if config_gib is not None else flag_gib
