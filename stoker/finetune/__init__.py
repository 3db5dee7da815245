"""`stoker finetune`: LoRA SFT with trl + peft, writing adapters that `stoker serve --lora-modules` loads.

config.py (flags, validated) -> data.py (JSONL rows) -> masking.py (ids + loss mask)
-> trainer.py (trl SFTTrainer) -> output_dir.py (checkpoints, resume, atomic publish) + plot.py.
"""
