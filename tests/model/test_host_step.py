"""The engine step's host work, made cheaper, does exactly what it did: the fast decode gives
tokenizer.decode's text, prepare_inputs the same tensors as the per-token loop it replaced,
StepMessage.shape the same counts, and LLM.generate (final-only outputs) the same results as
stepping the engine by hand."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.core.step import SeqStep, StepMessage, StepShape
from stoker.engine.detokenizer import fast_decode
from stoker.engine.tokenizer import load_tokenizer
from stoker.runner.inputs import prepare_inputs


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


def _windows(tok, rng: random.Random, count: int = 300) -> list[list[int]]:
    """Random id windows: plain tokens, special tokens, byte fragments of multi-byte characters."""
    text_ids = tok.encode("héllo wörld 🙂 naïve café ✓ done . , 's n't", add_special_tokens=False)
    special = sorted(set(tok.all_special_ids))
    vocab = len(tok)
    out = [[]]
    for _ in range(count):
        n = rng.randrange(1, 9)
        pool = rng.choice([text_ids, special + text_ids, list(range(vocab))])
        out.append([rng.choice(pool) for _ in range(n)])
    return out


def test_fast_decode_is_tokenizer_decode(tok) -> None:
    decode = fast_decode(tok)
    assert decode == tok.backend_tokenizer.decode  # the demo tokenizer: Rust-backed, no clean-up
    for window in _windows(tok, random.Random(0)):
        for skip in (True, False):
            assert decode(window, skip_special_tokens=skip) == tok.decode(window, skip_special_tokens=skip)


def test_fast_decode_keeps_clean_up_and_overrides(tok) -> None:
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True  # the clean-up (or the skip of it) stays transformers'
    decode = fast_decode(cleaning)
    assert decode != cleaning.backend_tokenizer.decode
    for window in _windows(cleaning, random.Random(1), 100):
        assert decode(window, skip_special_tokens=True) == cleaning.decode(window, skip_special_tokens=True)

    class Custom(type(tok)):  # a tokenizer with its own decode is called as it is
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "custom"

    custom = copy.deepcopy(tok)
    custom.__class__ = Custom
    assert fast_decode(custom)([1, 2], skip_special_tokens=True) == "custom"


def _reference_inputs(step: StepMessage, block_size: int):
    """prepare_inputs as it was: one Python append per token."""
    ordered = step.seqs
    input_ids, positions, slot_mapping, cu, context_lens, logits_indices = [], [], [], [0], [], []
    for s in ordered:
        input_ids.extend(s.token_ids)
        for pos in range(s.start_pos, s.context_len):
            positions.append(pos)
            slot_mapping.append(s.block_table[pos // block_size] * block_size + pos % block_size)
        cu.append(cu[-1] + s.num_tokens)
        context_lens.append(s.context_len)
        if s.do_sample:
            logits_indices.extend(range(cu[-1] - s.num_sampled, cu[-1]))
    max_blocks = max(len(s.block_table) for s in ordered)
    tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in ordered]
    return input_ids, positions, slot_mapping, cu, context_lens, logits_indices, tables


def _random_step(rng: random.Random, block_size: int) -> StepMessage:
    seqs = []
    next_block = 0
    for seq_id in range(rng.randrange(1, 40)):
        kind = rng.random()
        n = 1 if kind < 0.6 else rng.choice([2, 5, 63, 64, 65, 200])
        drafts = tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 4))) if 0.6 <= kind < 0.7 else ()
        n = max(n, 1 + len(drafts)) if drafts else n
        start = rng.randrange(0, 300)
        num_blocks = -(-(start + n) // block_size)
        table = list(range(next_block + num_blocks + 7, next_block + 7, -1))[::-1]  # any distinct ids
        next_block += num_blocks + 3
        tokens = [rng.randrange(1000) for _ in range(n - len(drafts))] + list(drafts)
        seqs.append(SeqStep(seq_id, tokens, start, table, rng.random() < 0.8, draft_token_ids=drafts))
    seqs.sort(key=lambda s: s.num_tokens != 1)
    return StepMessage(seqs)


@pytest.mark.parametrize("block_size", [1, 16])
def test_prepare_inputs_matches_the_per_token_loop(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(60):
        step = _random_step(rng, block_size)
        ids, pos, slots, cu, ctx, logits_idx, tables = _reference_inputs(step, block_size)
        got = prepare_inputs(step, block_size, torch.device("cpu"))
        md = got.attn_metadata
        assert got.input_ids.dtype == torch.int64 and got.input_ids.tolist() == ids
        assert got.positions.dtype == torch.int64 and got.positions.tolist() == pos
        assert md.slot_mapping.dtype == torch.int64 and md.slot_mapping.tolist() == slots
        assert md.block_tables.dtype == torch.int32 and md.block_tables.tolist() == tables
        assert md.context_lens.dtype == torch.int32 and md.context_lens.tolist() == ctx
        assert got.logits_indices.dtype == torch.int64 and got.logits_indices.tolist() == logits_idx
        assert md.cu_seqlens_q == cu and md.context_lens_list == ctx
        assert md.num_decodes == sum(1 for s in step.seqs if s.num_tokens == 1)
        assert got.sampled == [s for s in step.seqs if s.do_sample] and got.ordered is step.seqs
        assert got.has_drafts == any(s.draft_token_ids for s in got.sampled)


def _reference_shape(step: StepMessage) -> StepShape:
    prefill = attended = decodes = context = drafts = draft_attended = 0
    for s in step.seqs:
        d = len(s.draft_token_ids)
        if s.num_tokens - d == 1:
            decodes += 1
            context += s.start_pos + 1
            drafts += d
            draft_attended += sum(s.start_pos + 2 + j for j in range(d))
        else:
            prefill += s.num_tokens
            attended += sum(p + 1 for p in range(s.start_pos, s.context_len))
    return StepShape(prefill, attended, decodes, context, sum(s.num_sampled for s in step.seqs), drafts, draft_attended)


def test_step_shape_counts() -> None:
    rng = random.Random(7)
    for _ in range(50):
        step = _random_step(rng, 16)
        assert step.shape() == _reference_shape(step)


def test_generate_is_final_only_and_equals_stepping(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=8 << 20)
    engine = llm.engine
    tok = llm.get_tokenizer()
    prompts = ["The quick brown fox", "héllo wörld", "1 2 3", "Once upon"]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop=[tok.decode([50])[-1:] or "e"]),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=9, n=2)]
    generated = llm.generate(prompts, params, use_tqdm=False)

    # The same requests stepped by hand (cumulative outputs every step) end the same
    finals, seen_unfinished = {}, 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(engine.input_processor.process(f"h{i}", prompt, p, None))
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen_unfinished += not out.finished
            if out.finished:
                finals[out.request_id] = out
    assert seen_unfinished > 0  # streamed: an output every step
    for i, g in enumerate(generated):
        h = finals[f"h{i}"]
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in h.outputs]
        assert [c.logprobs for c in g.outputs] == [c.logprobs for c in h.outputs]
        assert g.finished and g.metrics.finished_time is not None

    # A final-only request: nothing from step() until it finishes, then its whole output once
    request = engine.input_processor.process("f", "The quick", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), None)
    engine.add_request(type(request)(**{**request.__dict__, "final_only": True}))
    got = []
    while engine.has_unfinished_requests():
        got.append(engine.step())
    assert all(not outs for outs in got[:-1]) and [o.finished for o in got[-1]] == [True]
    assert len(got[-1][0].outputs[0].token_ids) == 5
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class _NoKeep(dict):
    """A ModelRunner._rows that keeps nothing: every step builds every row afresh (as before)."""

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value) -> None:
        pass


def test_kept_sampling_rows_sample_as_fresh_ones(tiny_llama) -> None:
    """The runner keeps a sequence's SamplingRow between steps and updates only what a step
    changes: penalties see the output so far, min_tokens the count, seeded rows their own
    stream, n > 1 each completion's, bad words the output's tail, exactly as rows built afresh."""
    llm = LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=8 << 20)
    runner = llm.engine.executor.driver_runner
    eos = llm.engine.eos_token_ids[0]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.7,
                             presence_penalty=0.4),
              SamplingParams(temperature=0.9, seed=11, max_tokens=14, n=2, logprobs=3),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=10, stop_token_ids=[eos]),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=2, max_tokens=10,
                             bad_words=["the", " a"], logit_bias={7: 3.0})]
    prompts = ["The quick brown fox", "héllo wörld", "1 2 3", "Once upon", "a b a b a b"]

    def run() -> list:
        return [[(c.text, c.token_ids, c.finish_reason, c.cumulative_logprob, c.logprobs) for c in o.outputs]
                for o in llm.generate(prompts, params, use_tqdm=False)]

    kept = run()
    assert not runner._rows  # released with their sequences
    runner._rows = _NoKeep()
    try:
        fresh = run()
    finally:
        runner._rows = {}
    assert kept == fresh


def test_sampler_skips_prepare_only_for_plain_rows() -> None:
    from stoker.sampling.sampler import Sampler, SamplingRow

    torch.manual_seed(0)
    logits = torch.randn(6, 32)
    plain = SamplingParams(temperature=0)
    rows = [SamplingRow(plain, [], [], 0, None, (4,)) for _ in range(5)]
    assert all(r.plain and r.greedy and r.num_top is None for r in rows)
    out = Sampler(0, torch.device("cpu"))(logits[:5].clone(), rows)
    assert out.token_ids == logits[:5].argmax(dim=-1).tolist()
    # one row that is not plain: the whole batch goes through the rules, that row changed alone
    for special in (SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0, logit_bias={3: 100}),
                    SamplingParams(temperature=0, repetition_penalty=100.0), SamplingParams(temperature=0, bad_words=["x"])):
        top = int(logits[5].argmax())  # each rule takes it away: the EOS below min_tokens, a bias elsewhere,
        row = SamplingRow(special, [top], [top], 0, None, (top,), ((top,),))  # the penalty, the bad word
        assert not row.plain
        got = Sampler(0, torch.device("cpu"))(logits.clone(), rows + [row])
        assert got.token_ids[:5] == out.token_ids
        assert got.token_ids[5] != int(logits[5].argmax())
