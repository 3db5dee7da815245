"""The optional tokenizer behind `--tokenizer DIR`: exact prompt lengths, output re-counting.

Loaded lazily and only when asked for. A `tokenizer.json` is read with the light
`tokenizers` library; anything else falls back to `transformers.AutoTokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class BenchTokenizer:
    """encode/decode without special tokens (the server adds its own BOS, if any)."""

    name: str
    _encode: Any
    _decode: Any
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    def usable_ids(self) -> list[int]:
        """Ordinary token ids to draw random prompts from."""
        return [i for i in range(self.vocab_size) if i not in self.special_ids]


def load_tokenizer(path: str) -> BenchTokenizer:
    """Load the tokenizer at `path` (a directory or a tokenizer.json file)."""
    p = Path(path)
    json_file = p / "tokenizer.json" if p.is_dir() else p
    if json_file.name.endswith(".json") and json_file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(json_file))
        special = {t for t, a in tok.get_added_tokens_decoder().items() if a.special}
        # The unknown token decodes to a marker like "[UNK]" that re-encodes as several
        # tokens: drawing it would make exact lengths impossible.
        unk = getattr(tok.model, "unk_token", None)
        if unk is not None and tok.token_to_id(unk) is not None:
            special.add(tok.token_to_id(unk))
        return BenchTokenizer(
            name=str(path),
            _encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
            _decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            vocab_size=tok.get_vocab_size(),
            special_ids=frozenset(special),
        )
    if not p.exists():
        raise FileNotFoundError(f"--tokenizer {path}: no such file or directory")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(p))
    return BenchTokenizer(
        name=str(path),
        _encode=lambda text: hf.encode(text, add_special_tokens=False),
        _decode=lambda ids: hf.decode(ids, skip_special_tokens=True),
        vocab_size=len(hf),
        special_ids=frozenset(hf.all_special_ids),
    )
