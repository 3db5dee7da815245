"""Tokenizer and generation defaults from a checkpoint folder or a GGUF file (no network)."""

from __future__ import annotations

import copy
import functools
import json
import logging
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# transformers imports its modules lazily (on first attribute access, and from_pretrained
# imports the tokenizer class it finds). Two threads doing that at once in a fresh process can
# see a half-initialized module: "cannot import name 'AutoTokenizer' from 'transformers'".
# `stoker serve --config` loads the generative and the pooling models on separate threads, so
# every load goes through this lock (a tokenizer loads in well under a second).
_LOAD_LOCK = threading.Lock()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path) -> Any:
    if str(model_dir).lower().endswith(".gguf"):
        return _gguf_tokenizer(Path(model_dir))
    path = Path(model_dir)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer files in {path}: add tokenizer.json (or tokenizer.model / vocab.json + merges.txt) and tokenizer_config.json"
        )
    with _LOAD_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _gguf_tokenizer(path: Path) -> Any:
    """A GGUF file's tokenizer: the Hugging Face one of its folder when it has one, else the
    file's vocabulary (transformers converts it, offline); the chat template is the file's
    `tokenizer.chat_template` where the tokenizer has none."""
    from stoker.models.gguf_loader import chat_template

    if any((path.parent / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = load_tokenizer(path.parent)
    else:
        stat = path.stat()
        # A copy per caller (the server holds one per thread); the conversion, which re-reads
        # the file's whole metadata, runs once per file
        tokenizer = copy.deepcopy(_gguf_vocab_tokenizer(str(path.resolve()), stat.st_mtime_ns, stat.st_size))
    template = chat_template(path)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


@functools.lru_cache(maxsize=2)
def _gguf_vocab_tokenizer(path: str, mtime_ns: int, size: int) -> Any:
    with _LOAD_LOCK:
        from transformers import AutoTokenizer

        p = Path(path)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)


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
