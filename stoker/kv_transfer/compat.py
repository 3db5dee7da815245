"""The compatibility check of the handshake: two engines exchange KV blocks only when they lay
them out alike. [no torch]

Each side describes itself as named fields (model, dtype, KV dtype and scales, block size,
layout, TP size, Stoker version); the reader compares and refuses on the first field that
differs, naming it, rather than reading bytes it would misinterpret. The hash is what logs
and the handshake show.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

FIELDS = ("stoker_version", "model", "dtype", "kv_dtype", "kv_scales", "block_size", "num_layers", "num_kv_heads",
          "head_dim", "kv_tensors", "tp_size")


def compat_hash(fields: dict[str, Any]) -> str:
    text = json.dumps({k: fields.get(k) for k in FIELDS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """A sentence naming the first field that differs, or None when the layouts agree."""
    for name in FIELDS:
        if mine.get(name) != theirs.get(name):
            return (f"KV transfer refused: {name} differs (this engine: {mine.get(name)!r}, remote engine: "
                    f"{theirs.get(name)!r}); serve both engines with the same model, dtype, --kv-cache-dtype, "
                    f"--block-size and --tensor-parallel-size")
    return None


def scales_digest(scales: list[tuple[float, float]]) -> str:
    """Per-layer (k_scale, v_scale) in one short string: an FP8 cache read with another
    engine's scales would decode to other values."""
    return hashlib.sha256(json.dumps(scales).encode()).hexdigest()[:12]
