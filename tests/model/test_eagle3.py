"""EAGLE-3 drafting (method "eagle3") through the engine, with a tiny random head written in the
published layout (`LlamaForCausalLMEagle3`: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`;
no embedding, the target's is shared). Random weights propose nearly random drafts, so what
is tested is the loading and the verification path: output equal to decoding without drafts,
drafts really proposed and verified. Acceptance of a trained head cannot be measured here."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stoker import LLM, SamplingParams
from tests.model.helpers import ScriptedK, check_structured_with_drafts, output_token_ids, spec_llm, structured_cases

_make = functools.partial(spec_llm, max_num_seqs=8)  # the draft's scratch blocks: a few sequences


REPEAT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11] * 6}
PLAIN = {"prompt_token_ids": list(range(40, 75))}
PROMPTS = [REPEAT, PLAIN, {"prompt_token_ids": [300, 301, 302] * 10 + [7, 8]}, "hello there, how are you"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def write_eagle3_head(path: Path, target: Path, draft_vocab: int = 96, seed: int = 0, kept: list[int] | None = None,
                      **config) -> Path:
    """A one-layer EAGLE-3 head for `target` (hidden 64, vocab from its config) in the published
    layout; `kept`: the target ids of its draft vocabulary (else `draft_vocab` drawn at random)."""
    tc = json.loads((target / "config.json").read_text())
    hidden, vocab, inter = tc["hidden_size"], tc["vocab_size"], tc["intermediate_size"]
    heads, kv_heads = tc["num_attention_heads"], tc["num_key_value_heads"]
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    # the draft vocabulary: a sorted subset of the target's (as the published heads keep the most frequent ids)
    kept = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab] if kept is None else torch.tensor(kept)).values
    draft_vocab = len(kept)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + w(hidden, std=0.1),
        "midlayer.hidden_norm.weight": 1 + w(hidden, std=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(hidden, std=0.1),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": 1 + w(hidden, std=0.1),
        "lm_head.weight": w(draft_vocab, hidden, std=0.3),
        "d2t": kept - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
           "max_position_embeddings": tc["max_position_embeddings"], "rope_theta": tc.get("rope_theta", 10000.0),
           "tie_word_embeddings": False, "vocab_size": vocab, "draft_vocab_size": draft_vocab, **config}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def target(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama", num_hidden_layers=4)  # vLLM's default taps (2, L // 2, L - 3) need L >= 3


@pytest.fixture(scope="module")
def head(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eagle3_head(tmp_path_factory.mktemp("eagle3"), target)


@pytest.fixture(scope="module")
def base(target: Path) -> LLM:
    return _make(target, None)


@pytest.fixture(scope="module")
def eagle(target: Path, head: Path) -> LLM:
    return _make(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})


def test_greedy_output_equals_decoding_without_drafts(base: LLM, eagle: LLM) -> None:
    before = eagle.engine.stats().spec_decoding
    assert output_token_ids(eagle, PROMPTS, GREEDY) == output_token_ids(base, PROMPTS, GREEDY)
    after = eagle.engine.stats().spec_decoding
    assert after.num_drafts > before.num_drafts and after.num_draft_tokens > before.num_draft_tokens


def test_structured_outputs_stay_valid_and_lossless(base: LLM, eagle: LLM) -> None:
    """A random head's drafts are mostly refused by the grammar (cut before verification); the
    ones verified are checked against the target's masked rows."""
    check_structured_with_drafts(base, eagle, expect_accepted=False)


def test_the_head_maps_draft_ids_into_the_target_vocabulary(eagle: LLM, head: Path) -> None:
    """Every proposal is a target id the head's d2t reaches (a draft id left unmapped would
    almost surely fall outside the kept set)."""
    from safetensors.torch import load_file

    t = load_file(str(head / "model.safetensors"))
    reachable = set((torch.arange(t["d2t"].numel()) + t["d2t"]).tolist())
    engine = eagle.engine
    seen: list[int] = []
    execute = engine.executor.execute

    def spy(step):
        result = execute(step)
        for drafts in result.draft_token_ids.values():
            seen.extend(drafts)
        return result

    engine.executor.execute = spy
    try:
        output_token_ids(eagle, [REPEAT, PLAIN], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finally:
        engine.executor.execute = execute
    assert seen and set(seen) <= reachable


def test_chunked_prompts_and_pinned_layers_stay_lossless(target: Path, base: LLM, tmp_path: Path) -> None:
    """Long prompts cut into chunks (the head's carried row between chunks) and a head that names
    its target layers (eagle_aux_hidden_state_layer_ids)."""
    pinned = write_eagle3_head(tmp_path / "pinned", target, seed=3, eagle_aux_hidden_state_layer_ids=[0, 1, 3])
    llm = _make(target, {"method": "eagle3", "model": str(pinned), "num_speculative_tokens": 2},
                max_num_batched_tokens=24, enable_chunked_prefill=True)
    drafter = llm.engine.executor.driver_runner.drafter
    carried: list[int] = []

    class Carry(dict):  # counts the rows carried from one chunk to the next
        def __setitem__(self, seq_id, value):
            carried.append(seq_id)
            super().__setitem__(seq_id, value)

    drafter.carry = Carry()
    assert output_token_ids(llm, PROMPTS, GREEDY) == output_token_ids(base, PROMPTS, GREEDY)
    assert llm.engine.stats().spec_decoding.num_drafts > 0
    assert carried and not drafter.carry  # chunks carried a row; finished sequences left none behind


def test_seeded_sampling_is_reproducible(eagle: LLM) -> None:
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, ignore_eos=True, seed=11)
    assert output_token_ids(eagle, [REPEAT], p) == output_token_ids(eagle, [REPEAT, PLAIN], p)[:1]


def test_a_head_saved_as_pytorch_model_bin_loads_the_same(target: Path, head: Path, eagle: LLM, tmp_path: Path) -> None:
    """The original releases ship pytorch_model.bin: the same tensors give the same drafts."""
    import shutil

    from safetensors.torch import load_file

    bin_head = tmp_path / "bin"
    bin_head.mkdir()
    shutil.copy(head / "config.json", bin_head / "config.json")
    torch.save(load_file(str(head / "model.safetensors")), bin_head / "pytorch_model.bin")
    llm = _make(target, {"method": "eagle3", "model": str(bin_head), "num_speculative_tokens": 3})
    before = [eagle.engine.stats().spec_decoding.num_accepted_tokens]
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert output_token_ids(llm, [REPEAT, PLAIN], short) == output_token_ids(eagle, [REPEAT, PLAIN], short)
    a, b = llm.engine.stats().spec_decoding, eagle.engine.stats().spec_decoding
    assert a.num_draft_tokens > 0 and a.num_accepted_tokens == b.num_accepted_tokens - before[0]
    assert not list(bin_head.glob("*.safetensors"))  # the temporary copy is not left in the folder


def test_a_head_that_does_not_fit_the_target_is_refused(target: Path, tmp_path: Path) -> None:
    wrong = write_eagle3_head(tmp_path / "wrong", target, eagle_aux_hidden_state_layer_ids=[0, 1, 9])
    with pytest.raises(ValueError, match="three target layers"):
        _make(target, {"method": "eagle3", "model": str(wrong), "num_speculative_tokens": 2})
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        _make(target, {"method": "eagle3", "model": str(wrong), "num_speculative_tokens": 2})


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """(T, H, D) with Llama's rotary (rotate-half pairs)."""
    d = x.shape[-1]
    freqs = positions[:, None].float() * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _reference_drafts(head: Path, target: Path, prompt: list[int], k: int) -> list[int]:
    """The head's first k greedy drafts after a prefill of `prompt`, in plain torch from the
    checkpoint tensors and Hugging Face's hidden states of the target (hidden_states[j] is the
    residual stream entering layer j)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((head / "config.json").read_text())
    t = load_file(str(head / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    num_layers = hf.config.num_hidden_layers
    taps = (2, num_layers // 2, num_layers - 3)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        new = int(out.logits[0, -1].argmax())  # the target's sampled token
        aux = torch.cat([out.hidden_states[j][0] for j in taps], -1)  # (L, 3 x hidden)
        hidden = aux @ t["fc.weight"].T  # (L, hidden)
        embed = hf.model.embed_tokens.weight
        tokens = prompt[1:] + [new]  # row p reads the token at p + 1
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg["hidden_size"] // heads
        drafts: list[int] = []
        for _ in range(k):
            rows = len(tokens)
            x = torch.cat([_rms(embed[tokens], t["midlayer.input_layernorm.weight"]),
                           _rms(hidden, t["midlayer.hidden_norm.weight"])], -1)
            pos = torch.arange(rows)
            q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(rows, heads, d), pos, cfg["rope_theta"])
            kk = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(rows, kv_heads, d), pos, cfg["rope_theta"])
            v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(rows, kv_heads, d)
            rep = heads // kv_heads
            kk, v = kk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", q, kk) / d**0.5
            scores = scores.masked_fill(torch.triu(torch.ones(rows, rows, dtype=torch.bool), 1), float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(rows, heads * d)
            h = attn @ t["midlayer.self_attn.o_proj.weight"].T + hidden
            m = _rms(h, t["midlayer.post_attention_layernorm.weight"])
            mlp = (torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T))
            prenorm = mlp @ t["midlayer.mlp.down_proj.weight"].T + h
            best = int((_rms(prenorm[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
            drafts.append(best + int(t["d2t"][best]))
            tokens = tokens + [drafts[-1]]  # the next row: the draft token, the head's own output as hidden
            hidden = torch.cat([hidden, prenorm[-1:]])
    return drafts


def test_first_drafts_match_a_plain_torch_reference(eagle: LLM, head: Path, target: Path) -> None:
    """The layout, end to end: which target layers feed fc, the 2 x hidden attention input, the
    residuals, the pre-norm feedback, d2t. The engine's proposals after a prompt's prefill equal
    the reference computed from the checkpoint files."""
    prompt = list(range(40, 75))
    engine = eagle.engine
    proposals: list[list[int]] = []
    execute = engine.executor.execute

    def spy(step):
        result = execute(step)
        proposals.extend(result.draft_token_ids.values())
        return result

    engine.executor.execute = spy
    try:
        output_token_ids(eagle, [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        engine.executor.execute = execute
    assert proposals[0] == _reference_drafts(head, target, prompt, 3)


def _constrained_drafts(base: LLM, eagle: LLM, masked: bool) -> tuple[int, int]:
    """A structured-outputs batch -> (draft tokens the head proposed for it, those left after the
    cut before the first token a grammar refuses). Masked: the outputs are checked valid and
    lossless, with drafts verified."""
    runner = eagle.engine.executor.driver_runner
    proposed = kept = 0

    def allowed(step, drafts):
        nonlocal proposed, kept
        proposed += sum(len(d) for d in drafts.values())
        out = type(runner)._grammar_allowed(runner, step, drafts)
        kept += sum(len(d) for d in out.values())
        return out

    runner._grammar_allowed = allowed
    if not masked:
        runner._draft_mask = lambda step: None
    try:
        if masked:
            check_structured_with_drafts(base, eagle, expect_accepted=False)
        else:
            eagle.generate([p for p, _ in structured_cases()],
                           [SamplingParams(temperature=0, max_tokens=24, structured_outputs=so) for _, so in structured_cases()],
                           use_tqdm=False)
    finally:
        del runner._grammar_allowed
        runner.__dict__.pop("_draft_mask", None)
    return proposed, kept


def test_structured_outputs_mask_the_heads_own_drafts(base: LLM, target: Path, tmp_path: Path) -> None:
    """The head's argmax is taken within each sequence's grammar (structured/draft_mask.py), as a
    draft model's is: with a draft vocabulary of the target's whole vocabulary (the grammar's
    tokens are in it) its proposals pass the grammar and reach verification (only those drafted
    past the grammar's end are cut), where unmasked (the grammar only cutting them before the
    first token it refuses) nearly all are cut."""
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    head = write_eagle3_head(tmp_path / "eagle3-full", target, kept=list(range(vocab)))
    eagle = _make(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    proposed, kept = _constrained_drafts(base, eagle, masked=True)
    proposed_raw, kept_raw = _constrained_drafts(base, eagle, masked=False)
    assert proposed > 20 and kept > 0.6 * proposed
    assert kept_raw < 0.1 * proposed_raw


def test_k_zero_keeps_the_head_caught_up_without_proposing(base: LLM, eagle: LLM) -> None:
    """At k = 0 the head cannot defer its catch-up (its rows need the target's hidden states of
    the step that computed them): one forward over the step's rows, no proposal round, no LM head
    row; output stays decoding without drafts when k rises again."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = eagle.engine
    drafter = engine.executor.driver_runner.drafter
    policy, engine.spec_k_policy = engine.spec_k_policy, ScriptedK([0, 0, 3, 0, 2])
    steps: list[tuple[int | None, int, int]] = []
    execute = engine.executor.execute

    def spy(step):
        forwards = drafter.num_draft_forwards
        result = execute(step)
        steps.append((step.num_speculative_tokens, drafter.num_draft_forwards - forwards,
                      max((len(d) for d in result.draft_token_ids.values()), default=0)))
        return result

    engine.executor.execute = spy
    try:
        got = output_token_ids(eagle, PROMPTS[:2], params)
    finally:
        engine.executor.execute, engine.spec_k_policy = execute, policy
    assert got == output_token_ids(base, PROMPTS[:2], params)
    zero = [(forwards, longest) for k, forwards, longest in steps if k == 0]
    assert len(zero) > 8 and all(forwards == 1 and longest == 0 for forwards, longest in zero)
    assert any(longest == 3 for _, _, longest in steps)
