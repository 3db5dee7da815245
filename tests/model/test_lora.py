"""Multi-LoRA in the engine: greedy tokens equal HF transformers + peft's PeftModel on the same
tiny checkpoint and adapter; mixed batches; slot pressure; prefix-cache isolation; refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker import LLM, LoRARequest, SamplingParams
from stoker.lora.adapter import LoRAError
from tests.model.helpers import make_adapter, peft_greedy

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 17, 300, 42, 7, 99, 5], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [600, 2, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20, enable_lora=True, **{"max_lora_rank": 16, **kw})


@pytest.mark.parametrize("arch, targets, rank", [
    ("llama", ATTN + MLP, 8),
    ("llama", ATTN, 16),
    ("llama", MLP, 16),
    ("qwen2", ATTN + MLP, 8),
    ("qwen3", ATTN + MLP, 16),
])
def test_greedy_equals_peft(tiny_checkpoints, tmp_path: Path, arch: str, targets: list[str], rank: int) -> None:
    base = tiny_checkpoints(arch)
    adapter = make_adapter(base, tmp_path / "a", targets, rank, seed=1, rslora=arch == "qwen3")
    llm = _llm(base)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                         use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))]
    want = [peft_greedy(base, adapter, p, 10) for p in PROMPTS]
    assert got == want
    base_out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                              use_tqdm=False)]
    assert base_out != got  # the adapter changed something


def test_mixed_batch_and_slot_pressure(tiny_checkpoints, tmp_path: Path) -> None:
    """Base + four adapters in one batch with only two slots: every request gets its tokens as
    when run alone (requests wait for a slot, never fail)."""
    base = tiny_checkpoints("llama")
    adapters = [make_adapter(base, tmp_path / f"a{i}", ATTN + MLP if i % 2 else ATTN, 8, seed=10 + i) for i in range(4)]
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    llm = _llm(base, max_loras=2)
    alone = {}
    for r in [None, *reqs]:
        alone[r.lora_name if r else None] = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                                                         lora_request=r)[0].outputs[0].token_ids
    order = [None, reqs[0], reqs[1], reqs[2], reqs[3], reqs[0], None, reqs[2]]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * len(order), GREEDY, use_tqdm=False, lora_request=order)
    assert [o.outputs[0].token_ids for o in outs] == [alone[r.lora_name if r else None] for r in order]
    assert len(set(map(tuple, alone.values()))) == 5
    assert len(llm.engine.lora.slotted()) <= 2
    llm.engine.check_integrity()


def test_prefix_cache_is_keyed_by_adapter(tiny_checkpoints, tmp_path: Path) -> None:
    base = tiny_checkpoints("llama")
    a = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", ATTN, 8, seed=3)))
    llm = _llm(base)
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}
    bm = llm.engine.block_manager
    llm.generate(prompt, GREEDY, use_tqdm=False)  # the base model fills the cache
    hits = bm.prefix_cache_hits
    with_a = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert bm.prefix_cache_hits == hits and with_a.num_cached_tokens == 0  # the base's blocks are not the adapter's
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == with_a.outputs[0].token_ids


def test_bad_adapters_are_refused_by_name(tiny_checkpoints, tmp_path: Path) -> None:
    base = tiny_checkpoints("llama")
    llm = _llm(base, max_lora_rank=8)
    big = make_adapter(base, tmp_path / "big", ATTN, 16, seed=4)
    with pytest.raises(LoRAError, match="above --max-lora-rank 8"):
        llm.engine.load_lora("big", str(big))
    other = make_adapter(tiny_checkpoints("qwen3"), tmp_path / "other", ATTN, 8, seed=5)
    with pytest.raises(LoRAError, match="trained for another model|another model"):
        llm.engine.load_lora("other", str(other))
    dora = make_adapter(base, tmp_path / "dora", ATTN, 8, seed=6)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora"):
        llm.engine.load_lora("dora", str(dora))
    ok = make_adapter(base, tmp_path / "ok", ATTN, 8, seed=7)
    llm.engine.load_lora("ok", str(ok))
    with pytest.raises(LoRAError, match="already loaded"):
        llm.engine.load_lora("ok", str(ok))
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        llm.engine.input_processor.process("r", None, GREEDY, [1, 2], lora_name="nope")
    llm.engine.unload_lora("ok")
    assert not llm.engine.lora.has("ok") and llm.engine.lora.slotted() == []
    llm.engine.load_lora("ok", str(ok))  # the name is free again


def test_unloading_with_requests_in_flight_lets_them_finish(tiny_checkpoints, tmp_path: Path) -> None:
    base = tiny_checkpoints("llama")
    path = make_adapter(base, tmp_path / "a", ATTN + MLP, 8, seed=31)
    llm = _llm(base)
    want = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(path)))[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request(engine.input_processor.process("r", None, GREEDY, PROMPTS[0], lora_name="a"))
    engine.step()  # prefilled, running
    engine.unload_lora("a")
    assert not engine.lora.has("a") and engine.lora.slotted() == ["a"]  # gone for new requests, kept for "r"
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        engine.input_processor.process("r2", None, GREEDY, PROMPTS[1], lora_name="a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o for o in outs if o.finished][0].outputs[0].token_ids == want
    assert engine.lora.slotted() == []  # freed once its last request finished
    engine.check_integrity()
