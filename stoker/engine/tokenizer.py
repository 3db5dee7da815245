"""Tokenizer and generation defaults from a checkpoint folder (no network)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"no tokenizer files in {path}: add tokenizer.json (or tokenizer.model / vocab.json + merges.txt) and tokenizer_config.json"
        )
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def eos_token_ids(model_dir: str | Path, hf_config: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """EOS ids: generation_config.json first (it may list several, as Llama 3 does), then
    config.json, then the tokenizer."""
    ids: list[int] = []
    gen_file = Path(model_dir) / "generation_config.json"
    sources: list[Any] = []
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    sources += [hf_config.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)]
    for value in sources:
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if v not in ids:
                ids.append(int(v))
        break
    return tuple(ids)
