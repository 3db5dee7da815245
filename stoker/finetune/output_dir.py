"""The adapter folder: what may be in it, where to resume from, and how the adapter lands. [no torch]

Layout (vLLM's `--lora-modules name=DIR` and `PeftModel.from_pretrained(base, DIR)` read the top
two files; the rest is this command's own):
  DIR/adapter_config.json, DIR/adapter_model.safetensors   the trained adapter (PEFT's format)
  DIR/checkpoint-N/                                          HF Trainer checkpoints, for --resume
  DIR/loss_curve.png, DIR/finetune_log.json                  the run's loss history

Invariant: whenever DIR/adapter_config.json exists, DIR/adapter_model.safetensors is complete and
belongs to it. A server that finds the config loads a whole adapter; one that finds none refuses
the folder. `publish_adapter` keeps it by removing the old config first and moving the new
config in last, each file renamed whole from a temporary folder inside DIR.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")  # in publish order: config last
TMP_PREFIX = ".stoker-tmp-"
_OURS = re.compile(rf"^(checkpoint-\d+|adapter_config\.json|adapter_model\.safetensors|loss_curve\.png|"
                   rf"finetune_log\.json|{re.escape(TMP_PREFIX)}.*)$")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def last_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-N with the highest N that holds a trainer state (a complete save)."""
    best: tuple[int, Path] | None = None
    for entry in folder.iterdir() if folder.is_dir() else ():
        m = _CHECKPOINT.match(entry.name)
        if m and (entry / "trainer_state.json").is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), entry)
    return best[1] if best else None


def prepare_output_dir(folder: Path, resume: bool, overwrite: bool) -> Path | None:
    """Make `folder` ready to train into; return the checkpoint to resume from (None: start afresh).

    A non-empty folder is refused unless the run resumes it or `overwrite` says to start over,
    so neither a user's other files nor a previous run's checkpoints get mixed into this run.
    `overwrite` removes only what this command writes; any other file is left where it is.
    """
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output {folder} is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(TMP_PREFIX + "*"):  # a crashed publish's leftovers: never an adapter
        _remove(stale)
    entries = sorted(e.name for e in folder.iterdir())
    if resume:
        checkpoint = last_checkpoint(folder)
        if checkpoint is None:
            raise ValueError(f"--resume: {folder} holds no checkpoint-N folder to resume from")
        return checkpoint
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise ValueError(f"--output {folder} is not empty ({shown}); pass --overwrite to train a new adapter into it "
                         "or --resume to continue its last checkpoint")
    for name in entries:
        if _OURS.match(name):
            _remove(folder / name)
    return None


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def checkpoint_rank(checkpoint: Path) -> int | None:
    cfg = checkpoint / "adapter_config.json"
    return int(json.loads(cfg.read_text())["r"]) if cfg.is_file() else None


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def publish_adapter(saved: Path, folder: Path, base_model: str) -> None:
    """Move the adapter files that `save_pretrained` wrote into `saved` (inside `folder`) to
    `folder`'s top level, keeping the invariant in the module docstring."""
    for name in ADAPTER_FILES:
        if not (saved / name).is_file():
            raise RuntimeError(f"the trainer did not write {name} (found {sorted(p.name for p in saved.iterdir())})")
    # vLLM and Stoker compare it with the served model (a mismatch warns); peft fills it from the
    # path the model was loaded from, which is the value we want, so set it explicitly to be sure.
    cfg_path = saved / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_model
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in ADAPTER_FILES:
        _fsync(saved / name)
    (folder / "adapter_config.json").unlink(missing_ok=True)
    for name in ADAPTER_FILES:
        os.replace(saved / name, folder / name)
    shutil.rmtree(saved, ignore_errors=True)


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    tmp.write_bytes(data)
    os.replace(tmp, path)
