"""Multi-LoRA on CUDA: the Triton BGMV kernel (kernels/lora_bgmv.py) in the engine gives PEFT's
greedy tokens (float32), for a batch mixing the base model and two adapters.

As the other GPU files: in a plain `pytest` process this file re-runs itself in a subprocess
with TRITON_INTERPRET=0; `make test-gpu` runs the check directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoker import LLM, LoRARequest, SamplingParams
from tests.gpu.compiled import COMPILED, compiled_only, rerun_compiled
from tests.model.test_lora import ATTN, MLP, PROMPTS, make_adapter, peft_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.skipif(COMPILED, reason="this is the compiled run")
def test_compiled_lora_in_subprocess() -> None:
    rerun_compiled(__file__, timeout_s=900)


@compiled_only
def test_lora_on_cuda_equals_peft(tiny_checkpoints, tmp_path: Path) -> None:
    base = tiny_checkpoints("llama")
    adapters = {n: make_adapter(base, tmp_path / n, targets, 8, seed=s)
                for n, targets, s in (("a", ATTN + MLP, 41), ("b", ATTN, 42))}
    llm = LLM(str(base), device="cuda", dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    order = [None, "a", "b", "a"]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 4, greedy, use_tqdm=False,
                        lora_request=[LoRARequest(n, i + 1, str(adapters[n])) if n else None for i, n in enumerate(order)])
    for name, out in zip(order, outs):
        if name is not None:
            assert out.outputs[0].token_ids == peft_greedy(base, adapters[name], PROMPTS[0], 10)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
