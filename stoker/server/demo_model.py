"""The embedded default model: `stoker serve` with no MODEL_DIR serves this.

A small Llama-shaped checkpoint with random weights, made deterministically (fixed seed,
fixed config) on first run in the user's cache folder, with the bundled tokenizer and
Llama-3-style chat template. It is written to a temporary folder and renamed into place,
so an interrupted first run never leaves a half-written model behind.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from stoker.paths import cache_root

DEMO_NAME = "stoker-demo"
# Bumped whenever the config below changes, so an old cache is never served as the new one.
DEMO_VERSION = "v1"
DEMO_CONFIG = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)
DEMO_SEED = 1234

RANDOM_WEIGHTS_NOTICE = (
    "stoker serve: no MODEL_DIR given, serving the built-in demo model '{name}' from {path}.\n"
    "  Its weights are RANDOM: it speaks the OpenAI API correctly but its text is gibberish.\n"
    "  To serve a real model: stoker serve /path/to/hf-checkpoint (a folder with config.json,\n"
    "  *.safetensors and tokenizer files, e.g. from `huggingface-cli download`)."
)


def demo_model_dir(root: Path | None = None) -> Path:
    """The demo checkpoint's folder, made on first call."""
    target = (root or cache_root()) / f"demo-model-{DEMO_VERSION}"
    if (target / "config.json").is_file():
        return target
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=target.parent))
    try:
        make_tiny_checkpoint(tmp, arch="llama", seed=DEMO_SEED, **DEMO_CONFIG)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; theirs is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
