"""Shared helpers for the model tests: HF reference runs, PEFT adapters and their greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoker.core.spec_k_policy import SpecKPolicy


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
    """All-position logits of one fresh prompt through the engine's own model and paged cache,
    on the engine's device (CPU, or CUDA in tests/gpu)."""
    from stoker.layers.attention import AttentionMetadata
    from stoker.layers.forward_context import ForwardContext, set_forward_context

    runner = llm.engine.executor.driver_runner
    device = runner.device
    n = len(ids)
    bs = runner.block_size

    def tensor(values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(-(-n // bs), dtype=torch.int32, device=device)[None],
        context_lens=tensor([n], torch.int32),
        cu_seqlens_q=[0, n],
        context_lens_list=[n],
        num_decodes=0,
        prefill_cu_seqlens_q=tensor([0, n], torch.int32),
    )
    with torch.inference_mode(), set_forward_context(ForwardContext(metadata)):
        hidden = runner.model(tensor(ids), torch.arange(n, device=device))
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


def mixed_batch_prompts(seed: int = 1, lengths: tuple[int, ...] = (3, 17, 40, 95, 180),
                        shared_tails: tuple[int, ...] = (1, 9, 21)) -> list[list[int]]:
    """A one-token prompt, prompts of `lengths`, and prompts sharing a 32-token prefix (two
    full 16-token blocks: prefix-cache hits) with tails of `shared_tails` tokens."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(5, 1000) for _ in range(32)]
    ps = [[0]] + [[0] + [rng.randrange(5, 1000) for _ in range(n - 1)] for n in lengths]
    return ps + [shared + [rng.randrange(5, 1000) for _ in range(k)] for k in shared_tails]


@torch.no_grad()
def hf_token_logprobs(hf, prompt: list[int], tokens: list[int]) -> list[float]:
    """HF's log-probability of each generated token, from one forward over prompt + tokens."""
    logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def check_mixed_batch_vs_hf(path: Path, prompts: list[list[int]], *, max_new: int, num_blocks: int = 24,
                            max_model_len: int = 256, budget: int = 64, skip=None) -> None:
    """One batch of `prompts` on a KV cache of `num_blocks` 16-token blocks (too few: preemption
    is certain) with a `budget`-token step (long prompts are chunked): each prompt's greedy
    tokens equal HF's greedy path for it alone, their logprobs within 1e-4; the prefix cache
    was hit, a sequence was preempted, and every block is free and whole afterwards.
    `skip(ids)`: prompts the comparison leaves out (they still run in the batch)."""
    from stoker import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=max_model_len, block_size=16, num_gpu_blocks_override=num_blocks,
              max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.block_manager.prefix_cache_hits > 0, "the test should hit the prefix cache"
    assert llm.engine.scheduler.num_preemptions > 0, "the test should force preemption"
    hf = load_hf(path)
    for ids, out in zip(prompts, outs):
        if skip is not None and skip(ids):
            continue
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, ids, max_new), f"prompt of length {len(ids)}"
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)]
        assert ours == pytest.approx(hf_token_logprobs(hf, ids, tokens), abs=1e-4)
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == num_blocks


def spec_llm(path: Path, spec: dict | None, **kw):
    """A small engine on `path` with `spec` as its speculative_config (None: no speculation), for
    the speculative-decoding tests: a 4 MiB cache and 256 positions unless kw says otherwise."""
    from stoker import LLM

    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    kw.setdefault("max_model_len", 256)
    return LLM(str(path), speculative_config=spec, **kw)


def output_token_ids(llm, prompts, params) -> list[list[int]]:
    """Each prompt's first completion's token ids."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# Structured outputs with speculative decoding: a JSON schema, a regex and a choice, each on a
# prompt that repeats text the grammar accepts, so n-gram and suffix drafts fire in the output.
STRUCTURED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "enum": ["ann", "bob", "cy"]},
                                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                     "required": ["name", "age"], "additionalProperties": False}
STRUCTURED_REGEX = "[0-9]{3}-[a-z]{2,6}"
STRUCTURED_CHOICE = ("yes please", "no thanks", "maybe later")


def structured_cases() -> list[tuple[str, object]]:
    """(prompt, StructuredOutputs) per kind."""
    from stoker.structured.spec import StructuredOutputs

    return [('{"name": "bob", "age": 41} ' * 4, StructuredOutputs.from_schema(STRUCTURED_SCHEMA)),
            ("379-ingot 812-lo 379-ingot " * 3, StructuredOutputs(regex=STRUCTURED_REGEX)),
            ("maybe later, yes please, no thanks. " * 3, StructuredOutputs(choice=STRUCTURED_CHOICE))]


def check_structured_with_drafts(base, spec, max_tokens: int = 24, expect_accepted: bool = True):
    """The three kinds in one batch, greedy: with drafts each output is valid under its grammar
    and token for token the output without drafts; drafts were made (and accepted, unless the
    drafter is random, as a random EAGLE-3 head is). -> the counters' before and after."""
    import json
    import re

    import jsonschema

    from stoker import SamplingParams

    cases = structured_cases()
    prompts = [p for p, _ in cases]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so) for _, so in cases]
    before = spec.engine.stats().spec_decoding
    got = spec.generate(prompts, params, use_tqdm=False)
    after = spec.engine.stats().spec_decoding
    want = base.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    texts = [o.outputs[0].text for o in got]
    assert all(o.outputs[0].finish_reason == "stop" for o in got), texts
    jsonschema.validate(json.loads(texts[0]), STRUCTURED_SCHEMA)
    assert re.fullmatch(STRUCTURED_REGEX, texts[1]), texts[1]
    assert texts[2] in STRUCTURED_CHOICE, texts[2]
    assert after.num_drafts > before.num_drafts, "nothing was drafted"
    if expect_accepted:
        assert after.num_accepted_tokens > before.num_accepted_tokens, "no draft was accepted"
    return before, after


class ScriptedK(SpecKPolicy):
    """The engine's k per step from a script (cycled), as the cost model would choose it under a
    load that comes and goes: no pricing, so the steps at k = 0 are known."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(max(ks), None)
        self.ks, self.i = ks, 0

    def choose(self, seqs, prefill_tokens: int = 0, prefill_attended: int = 0) -> int:
        k, self.i = self.ks[self.i % len(self.ks)], self.i + 1
        self.last_k = k
        return k


def teacher_forced_positions() -> list[int]:
    """The 256 token ids the quantization quality tests score, teacher-forced (seeded)."""
    import random

    rng = random.Random(0)
    return [0] + [rng.randrange(5, 1000) for _ in range(255)]


def kl_and_top1(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(T, V) logits of a reference and of a quantized run -> (mean KL(ref || out), top-1 agreement)."""
    lp, lq = ref.log_softmax(-1), out.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return float(kl.mean()), float((ref.argmax(-1) == out.argmax(-1)).float().mean())
