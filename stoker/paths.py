"""Where Stoker keeps what it makes on first use (the demo model, built CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$STOKER_CACHE_DIR`, else `$XDG_CACHE_HOME/stoker`, else `~/.cache/stoker`."""
    explicit = os.environ.get("STOKER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "stoker"
