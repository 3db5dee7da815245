"""One LoRA fine-tuning run: JSONL rows -> trl SFTTrainer + peft -> a PEFT adapter folder.

Order matters for the user: every data row is checked (and the output folder judged) before the
model is loaded, so a bad line 9,000 costs a second, not a training run. The adapter reaches the
output folder's top level only after training ends (output_dir.publish_adapter); an interrupted
run leaves checkpoints that `--resume` continues, never a half-written adapter.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.finetune.config import FinetuneConfig
from stoker.finetune.data import Row, read_rows, split_rows
from stoker.finetune.masking import Features, featurize
from stoker.finetune.output_dir import (
    TMP_PREFIX,
    checkpoint_rank,
    prepare_output_dir,
    publish_adapter,
    write_atomically,
)
from stoker.finetune.plot import loss_points, plot_loss_curve

if TYPE_CHECKING:
    from transformers import TrainerCallback


@dataclass(frozen=True)
class FinetuneResult:
    output: Path
    base_model: str
    global_step: int
    num_train_rows: int
    num_eval_rows: int
    train_loss: float | None  # last logged
    eval_loss: float | None  # at the last step
    resumed_from: str | None
    runtime_s: float


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def finetune(cfg: FinetuneConfig, callbacks: Sequence[TrainerCallback] = (),
             say: Callable[[str], None] = _stderr) -> FinetuneResult:
    """Train a LoRA adapter as `cfg` says and publish it to `cfg.output`."""
    started = time.perf_counter()
    _require("trl", "peft", "datasets")
    train_rows = read_rows(cfg.data)
    if cfg.eval_data is not None:
        eval_rows = read_rows(cfg.eval_data)
        eval_source = cfg.eval_data
    else:
        train_rows, eval_rows = split_rows(train_rows, cfg.eval_split, cfg.seed)
        eval_source = cfg.data
    resume_from = prepare_output_dir(cfg.output, cfg.resume, cfg.overwrite)
    if resume_from is not None and checkpoint_rank(resume_from) not in (None, cfg.lora_rank):
        raise ValueError(f"--resume: {resume_from.name} was trained with --lora-rank {checkpoint_rank(resume_from)}, "
                         f"not {cfg.lora_rank}; resume with the flags of the first run")

    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from stoker.runner.device import resolve_device

    device = resolve_device(cfg.device).type
    use_bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
    base_model = str(Path(cfg.model).resolve()) if Path(cfg.model).is_dir() else cfg.model
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    transformers.set_seed(cfg.seed)  # before peft draws the LoRA A matrices
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.bfloat16 if use_bf16 else torch.float32)
    max_seq_len = cfg.max_seq_len or min(1024, int(getattr(model.config, "max_position_embeddings", 1024)))

    train_feats = _featurize_all(tokenizer, train_rows, max_seq_len, cfg.data, say)
    eval_feats = _featurize_all(tokenizer, eval_rows, max_seq_len, eval_source, say)
    total_steps = cfg.total_steps(len(train_feats))
    say(f"finetune: {len(train_feats)} train rows ({_tokens(train_feats)}), {len(eval_feats)} eval rows; "
        f"{total_steps} steps of {cfg.rows_per_step} rows on {device}"
        + (f"; resuming from {resume_from.name}" if resume_from else ""))

    # The mask column is trl's "assistant_masks": its SFTTrainer builds labels from it (token where
    # 1, -100 where 0) for any pre-tokenized dataset, whatever assistant_only_loss says.
    def dataset(feats: list[Features]) -> Any:
        return Dataset.from_dict({"input_ids": [f.input_ids for f in feats],
                                  "assistant_masks": [f.assistant_masks for f in feats]})

    has_eval = bool(eval_feats)
    sft_args = SFTConfig(
        output_dir=str(cfg.output),
        max_length=max_seq_len,
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps or -1,
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        seed=cfg.seed,
        data_seed=cfg.seed,
        logging_steps=cfg.logging_steps or max(1, total_steps // 25),
        eval_strategy="steps" if has_eval else "no",
        eval_steps=cfg.eval_steps or max(1, total_steps // 10),
        eval_on_start=has_eval and resume_from is None,  # the curve starts at the base model's loss
        save_strategy="steps",
        save_steps=cfg.save_steps or max(1, total_steps // 5),
        save_total_limit=cfg.save_total_limit,
        bf16=use_bf16,  # set either way: trl's SFTConfig otherwise turns bf16 on, even on a CPU
        gradient_checkpointing=cfg.gradient_checkpointing,
        use_cpu=device == "cpu",
        report_to="none",
        disable_tqdm=False,  # the progress bar
        dataloader_num_workers=0,
    )
    alpha = int(cfg.lora_alpha) if float(cfg.lora_alpha).is_integer() else cfg.lora_alpha
    lora = LoraConfig(task_type="CAUSAL_LM", r=cfg.lora_rank, lora_alpha=alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), use_rslora=cfg.use_rslora, bias="none")
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=dataset(train_feats),
                         eval_dataset=dataset(eval_feats) if has_eval else None, processing_class=tokenizer,
                         peft_config=lora, callbacks=list(callbacks))
    # trl writes a README.md model card into the output folder at every checkpoint: it names the
    # base as "None", shows a hub snippet that cannot run, and would replace a user's own README.
    trainer.create_model_card = lambda *args, **kwargs: None
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except KeyboardInterrupt:
        say(f"finetune: interrupted; the checkpoints in {cfg.output} continue with --resume")
        raise
    history = trainer.state.log_history
    if has_eval and not any(e.get("step") == trainer.state.global_step and "eval_loss" in e for e in history):
        trainer.evaluate()  # the final adapter's eval loss, when the schedule did not land on the last step

    saved = cfg.output / f"{TMP_PREFIX}adapter"
    trainer.save_model(str(saved))
    publish_adapter(saved, cfg.output, base_model)
    train_pts, eval_pts = loss_points(history)
    plot_loss_curve(history, cfg.output / "loss_curve.png",
                    f"LoRA r={cfg.lora_rank} on {Path(base_model).name}: {len(train_feats)} rows, "
                    f"{trainer.state.global_step} steps")
    result = FinetuneResult(
        output=cfg.output, base_model=base_model, global_step=trainer.state.global_step,
        num_train_rows=len(train_feats), num_eval_rows=len(eval_feats),
        train_loss=train_pts[-1][1] if train_pts else None, eval_loss=eval_pts[-1][1] if eval_pts else None,
        resumed_from=resume_from.name if resume_from else None, runtime_s=time.perf_counter() - started)
    log = {"result": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()},
           "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
           "device": device, "max_seq_len": max_seq_len, "log_history": history}
    write_atomically(cfg.output / "finetune_log.json", json.dumps(log, indent=2).encode())
    return result


def _require(*names: str) -> None:
    """Fail in a millisecond, before any file is written, when the finetune extra is missing."""
    from importlib.util import find_spec

    for name in names:
        if find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _featurize_all(tokenizer: Any, rows: list[Row], max_seq_len: int, source: Path,
                   say: Callable[[str], None]) -> list[Features]:
    feats = [featurize(tokenizer, r, max_seq_len, where=f"{source}:{r.line}") for r in rows]
    cut = [f.line for f in feats if f.truncated]
    if cut:
        say(f"finetune: {len(cut)} rows of {source} are longer than --max-seq-len {max_seq_len} and were cut "
            f"(first: line {cut[0]})")
    return feats


def _tokens(feats: list[Features]) -> str:
    total = sum(len(f.input_ids) for f in feats)
    trained = sum(f.num_trained for f in feats)
    return f"{total} tokens, {trained} of them trained on"
