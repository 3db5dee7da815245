"""`stoker finetune`: LoRA supervised fine-tuning whose output `stoker serve --lora-modules` serves.

Registration is light (argparse only); torch, trl and peft are imported when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stoker.finetune.config import SERVABLE_TARGETS, FinetuneConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "finetune", help="train a LoRA adapter (SFT on chat or prompt/completion JSONL) that `serve` can load",
        description="Supervised fine-tuning with LoRA through trl's SFTTrainer and peft. The loss is taken on the "
                    "assistant turns (chat rows) or the completion (prompt/completion rows) only. Writes PEFT's "
                    "adapter_config.json + adapter_model.safetensors to --output, with checkpoints, a loss curve "
                    "(loss_curve.png) and finetune_log.json beside them. See docs/finetune.md.")
    p.add_argument("--model", required=True, help="base checkpoint folder (config.json, safetensors, tokenizer)")
    p.add_argument("--data", required=True, type=Path,
                   help='training JSONL: {"messages": [...]} or {"prompt": ..., "completion": ...} per line')
    p.add_argument("--output", required=True, type=Path, help="adapter folder to write (ADAPTER_DIR)")
    ev = p.add_mutually_exclusive_group()
    ev.add_argument("--eval-data", type=Path, default=None, help="evaluation JSONL (default: hold out --eval-split)")
    ev.add_argument("--eval-split", type=float, default=0.1,
                    help="fraction of --data held out for evaluation (default 0.1; 0: no evaluation)")
    lo = p.add_argument_group("LoRA")
    lo.add_argument("--lora-rank", type=int, default=16, help="r (default 16; serve with --max-lora-rank >= r)")
    lo.add_argument("--lora-alpha", type=float, default=32.0, help="scaling numerator: alpha/r (default 32)")
    lo.add_argument("--lora-dropout", type=float, default=0.05)
    lo.add_argument("--use-rslora", action="store_true", help="scale by alpha/sqrt(r) (rsLoRA)")
    lo.add_argument("--target-modules", default=",".join(SERVABLE_TARGETS),
                    help=f"comma-separated projections (default all: {','.join(SERVABLE_TARGETS)})")
    tr = p.add_argument_group("training")
    tr.add_argument("--epochs", type=float, default=3.0, help="passes over the data (default 3)")
    tr.add_argument("--max-steps", type=int, default=None, help="optimizer steps; overrides --epochs")
    tr.add_argument("--learning-rate", type=float, default=2e-4)
    tr.add_argument("--batch-size", type=int, default=4, help="rows per micro-batch (default 4)")
    tr.add_argument("--gradient-accumulation-steps", type=int, default=1)
    tr.add_argument("--max-seq-len", type=int, default=None,
                    help="tokens per row; longer rows are cut (default min(1024, the model's context))")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--logging-steps", type=int, default=None, help="train-loss points (default: ~25 over the run)")
    tr.add_argument("--eval-steps", type=int, default=None, help="steps between evaluations (default: ~10 per run)")
    tr.add_argument("--save-steps", type=int, default=None, help="steps between checkpoints (default: a fifth of the run)")
    tr.add_argument("--save-total-limit", type=int, default=2, help="checkpoints kept (default 2)")
    tr.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="recompute activations in the backward pass: ~20%% slower, much less memory (default on)")
    tr.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    out = p.add_argument_group("output folder")
    out.add_argument("--resume", action="store_true", help="continue from the last checkpoint-N in --output")
    out.add_argument("--overwrite", action="store_true",
                     help="train into a non-empty --output (this command's previous files there are removed)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    return FinetuneConfig(
        model=args.model, data=args.data, output=args.output, eval_data=args.eval_data,
        eval_split=0.0 if args.eval_data is not None else args.eval_split,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        use_rslora=args.use_rslora,
        target_modules=tuple(t.strip() for t in args.target_modules.split(",") if t.strip()),
        epochs=args.epochs, max_steps=args.max_steps, learning_rate=args.learning_rate, batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_seq_len=args.max_seq_len, seed=args.seed,
        logging_steps=args.logging_steps, eval_steps=args.eval_steps, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, gradient_checkpointing=args.gradient_checkpointing, resume=args.resume, overwrite=args.overwrite, device=args.device,
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from stoker.finetune.trainer import finetune

    try:
        result = finetune(config_from_args(args))
    except ModuleNotFoundError as exc:
        if exc.name not in ("trl", "peft", "datasets"):
            raise
        print(f"stoker finetune: error: it needs {exc.name}, which is not installed: "
              "pip install 'stoker[finetune]' (trl and peft)", file=sys.stderr)
        return 2
    losses = ", ".join(f"{name} loss {v:.4f}" for name, v in (("train", result.train_loss),
                                                                ("eval", result.eval_loss)) if v is not None)
    print(f"adapter: {result.output} ({result.global_step} steps, {losses}; {result.runtime_s:.1f} s)")
    print(f"serve:   stoker serve {result.base_model} --enable-lora --lora-modules NAME={result.output.resolve()}")
    return 0
