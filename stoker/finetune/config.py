"""What one `stoker finetune` run is asked to do, validated once. [no torch]

Frozen like the engine's configs (DESIGN.md principle 4): flags become a `FinetuneConfig`,
`__post_init__` refuses what cannot work before any model is loaded, and the trainer reads
derived values from properties instead of re-deciding them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

# The projections `stoker serve --lora-modules` can apply a LoRA delta to (stoker/lora/adapter.py
# TARGETS, and vLLM's set for Llama/Qwen). Training any other module would write an adapter that
# serving refuses, so it is refused here, before the hours of training.
SERVABLE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEVICES = ("auto", "cpu", "cuda")


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class FinetuneConfig:
    model: str  # checkpoint folder (or HF repo id already in the local cache)
    data: Path  # training JSONL
    output: Path  # the adapter folder: adapter_config.json + adapter_model.safetensors + checkpoint-N/
    eval_data: Path | None = None
    eval_split: float = 0.1  # fraction of `data` held out when `eval_data` is not given; 0 disables evaluation
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    use_rslora: bool = False  # scaling alpha/sqrt(r) instead of alpha/r (rsLoRA, arXiv:2312.03732)
    target_modules: tuple[str, ...] = SERVABLE_TARGETS
    epochs: float = 3.0
    max_steps: int | None = None  # when set, overrides `epochs`
    learning_rate: float = 2e-4
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    max_seq_len: int | None = None  # None: min(1024, the model's max_position_embeddings)
    seed: int = 0
    logging_steps: int | None = None  # None: about 25 points on the loss curve
    eval_steps: int | None = None  # None: about 10 evaluations
    save_steps: int | None = None  # None: a checkpoint every fifth of the run
    save_total_limit: int = 2
    # Recompute activations in the backward pass: ~20% slower, far less memory (trl's default too).
    gradient_checkpointing: bool = True
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("lora_rank", "lora_alpha", "epochs", "learning_rate", "batch_size",
                     "gradient_accumulation_steps", "max_steps", "max_seq_len", "logging_steps", "eval_steps",
                     "save_steps", "save_total_limit"):
            _positive(name.replace("_", "-"), getattr(self, name))
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0.0 <= self.eval_split < 1.0:
            raise ValueError(f"eval-split must be in [0, 1), got {self.eval_split}")
        if not self.target_modules:
            raise ValueError("target-modules is empty; name at least one of " + ",".join(SERVABLE_TARGETS))
        unservable = sorted(set(self.target_modules) - set(SERVABLE_TARGETS))
        if unservable:
            raise ValueError(f"target-modules {','.join(unservable)} cannot be served by `stoker serve --lora-modules`; "
                             f"choose from {','.join(SERVABLE_TARGETS)}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the checkpoints in the output folder and --overwrite discards them; "
                             "pass one of them")

    @property
    def has_eval(self) -> bool:
        return self.eval_data is not None or self.eval_split > 0

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.gradient_accumulation_steps

    def total_steps(self, num_train_rows: int) -> int:
        """Optimizer steps the run takes: HF Trainer's count (batches per epoch, then accumulation)."""
        if self.max_steps is not None:
            return self.max_steps
        batches = math.ceil(num_train_rows / self.batch_size)
        # A last, partial accumulation still steps the optimizer (transformers >= 4.46 counts it).
        steps_per_epoch = max(1, math.ceil(batches / self.gradient_accumulation_steps))
        return max(1, math.ceil(self.epochs * steps_per_epoch))
