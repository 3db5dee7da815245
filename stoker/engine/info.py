"""What a built engine is, for those who price or describe it (the server, the live wall, the
speculative k policy): fixed once the engine is built, safe to read from any thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.config import CacheConfig
from stoker.executor.contract import RunnerInfo


@dataclass(frozen=True)
class EngineInfo:
    """What the served engine is: fixed once it is built, safe to read from any thread."""

    model_path: str
    hf_config: dict[str, Any]  # the checkpoint's config.json (read, never changed)
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_loras: int | None  # LoRA slots; None: LoRA is off
    cache_config: CacheConfig
    tensor_parallel_size: int
    runner: RunnerInfo  # rank 0's device, dtypes, KV spec
