"""Shared helpers for the model tests: HF reference runs."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_logits(model, prompt_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt_ids])).logits[0].float()
