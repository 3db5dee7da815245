"""Shared helpers for the model tests: HF reference runs, PEFT adapters and their greedy tokens."""

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


def engine_logits(llm, ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt through the engine's own model and paged cache."""
    from stoker.layers.attention import AttentionMetadata
    from stoker.layers.forward_context import ForwardContext, set_forward_context

    runner = llm.engine.executor.driver_runner
    n = len(ids)
    bs = runner.block_size
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(-(-n // bs), dtype=torch.int32)[None],
        context_lens=torch.tensor([n], dtype=torch.int32),
        cu_seqlens_q=[0, n],
        context_lens_list=[n],
        num_decodes=0,
    )
    with torch.inference_mode(), set_forward_context(ForwardContext(metadata)):
        hidden = runner.model(torch.tensor(ids), torch.arange(n))
        return runner.model.compute_logits(hidden)


def make_adapter(base: Path, out: Path, targets: list[str], rank: int, seed: int, rslora: bool = False) -> Path:
    """A PEFT adapter with random (not zero) B matrices, saved in PEFT's format."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = load_hf(base)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  lora_dropout=0.0, use_rslora=rslora))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name or "lora_A" in name:
            p.data.normal_(0, 0.2)
    peft_model.save_pretrained(str(out))
    return out


@torch.no_grad()
def peft_greedy(base: Path, adapter: Path, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf(base), str(adapter)).eval()
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n)
    return out[0, len(prompt):].tolist()
