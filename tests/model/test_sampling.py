"""The sampler against probabilities computed by hand, and seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from stoker.sampling.penalties import apply_penalties
from stoker.sampling.sampler import Sampler, SamplingRow
from stoker.sampling_params import SamplingParams

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]


def rows(params: SamplingParams, n: int, gen=None) -> list[SamplingRow]:
    return [SamplingRow(params, [], [], 0, gen, (4,)) for _ in range(n)]


def frequencies(params: SamplingParams, n: int = 20000, seed: int = 0) -> list[float]:
    logits = torch.tensor([PROBS]).log().repeat(n, 1)
    out = Sampler(seed, torch.device("cpu"))(logits, rows(params, n))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(PROBS)).float()
    return (counts / n).tolist()


def renormalised(keep: list[int]) -> list[float]:
    total = sum(PROBS[i] for i in keep)
    return [PROBS[i] / total if i in keep else 0.0 for i in range(len(PROBS))]


@pytest.mark.parametrize(
    "params, keep",
    [
        (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4]),
        (SamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
        (SamplingParams(temperature=1.0, top_p=0.7), [0, 1]),  # 0.5 + 0.2 reaches 0.7
        (SamplingParams(temperature=1.0, top_p=0.75), [0, 1, 2]),
        (SamplingParams(temperature=1.0, min_p=0.35), [0, 1]),  # threshold 0.175
        (SamplingParams(temperature=1.0, top_k=4, top_p=0.8), [0, 1, 2]),
    ],
)
def test_filters_match_hand_computed_distribution(params, keep) -> None:
    freq = frequencies(params)
    expected = renormalised(keep)
    for f, e in zip(freq, expected):
        assert abs(f - e) < 0.015, (freq, expected)


def test_temperature_sharpens_as_computed() -> None:
    t = 0.5
    freq = frequencies(SamplingParams(temperature=t))
    powered = [p ** (1 / t) for p in PROBS]
    expected = [p / sum(powered) for p in powered]
    for f, e in zip(freq, expected):
        assert abs(f - e) < 0.015


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = Sampler(0, torch.device("cpu"))(logits.clone(), rows(SamplingParams(temperature=0, logprobs=2), 1))
    assert out.token_ids == [1]
    expected = torch.log_softmax(logits, -1)[0]
    assert out.logprobs[0] == pytest.approx(expected[1].item())
    rank, ids, vals = out.top_logprobs[0]
    assert rank == 1 and ids == [1, 2] and vals == pytest.approx([expected[1].item(), expected[2].item()])


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    one = lambda v: torch.tensor([v])  # noqa: E731
    # repetition 2 on tokens seen in prompt (0) or output (1): 2 -> 1, -1 -> -2
    out = apply_penalties(logits.clone(), [[0]], [[1]], one(2.0), one(0.0), one(0.0))
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.0]]
    # frequency 0.5 x count, presence 0.3 once, on output tokens only (token 3 twice, token 0 in prompt only)
    out = apply_penalties(logits.clone(), [[0]], [[3, 3]], one(1.0), one(0.5), one(0.3))
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 0.5, 1.0 - 1.0 - 0.3])


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 10.0, 9.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    out = Sampler(0, torch.device("cpu"))(logits.clone(), [SamplingRow(p, [], [7], 1, None, (4,))])
    assert out.token_ids[0] not in (4, 5)
    out = Sampler(0, torch.device("cpu"))(logits.clone(), [SamplingRow(p, [], [7, 8], 2, None, (4,))])
    assert out.token_ids == [4]


def test_seeded_row_ignores_the_rest_of_the_batch() -> None:
    p = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))

    def draw(batch_extra: int) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        sampler = Sampler(123, torch.device("cpu"))
        tokens = []
        for _ in range(20):
            rs = rows(SamplingParams(temperature=1.0), batch_extra) + [SamplingRow(p, [], [], 0, gen, ())]
            batch = torch.cat([torch.randn(batch_extra, 50), logits]) if batch_extra else logits.clone()
            tokens.append(sampler(batch, rs).token_ids[-1])
        return tokens

    assert draw(0) == draw(3) == draw(9)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
     ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("n", 0),
     ("max_tokens", 0), ("logprobs", -1), ("stop", [""]), ("min_tokens", -1)],
)
def test_invalid_values_name_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_k_minus_one_means_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert math.isclose(SamplingParams(temperature=0).temperature, 0.0)


def test_bad_words_ban_a_words_last_token_after_the_rest() -> None:
    def sample(output_ids: list[int]) -> int:
        p = SamplingParams(temperature=0.0, bad_words=["x"])
        logits = torch.zeros(1, 16)
        logits[0, 8], logits[0, 9], logits[0, 3] = 3.0, 2.0, 1.0
        row = SamplingRow(p, [], output_ids, len(output_ids), None, (), ((7, 8), (9,)))
        return Sampler(0, torch.device("cpu"))(logits, [row]).token_ids[0]

    assert sample([1, 7]) == 3  # 8 completes [7, 8]; 9 is a one-token bad word: both banned
    assert sample([7, 1]) == 8  # the output does not end with 7: 8 is fine


def test_logit_bias_and_allowed_token_ids() -> None:
    logits = torch.zeros(2, 16)
    logits[:, 5] = 1.0
    rows = [SamplingRow(SamplingParams(temperature=0.0, logit_bias={2: 100}), [], [], 0, None, ()),
            SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[11, 12]), [], [], 0, None, ())]
    out = Sampler(0, torch.device("cpu"))(logits, rows)
    assert out.token_ids[0] == 2 and out.token_ids[1] in (11, 12)
    assert out.logprobs[0] < -1  # the reported logprob is the model's, before the bias


def test_bad_words_offline(tiny_llama) -> None:
    from stoker import LLM

    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=128)
    tok = llm.get_tokenizer()
    prompt = {"prompt_token_ids": [1, 17, 300, 42]}
    free = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    # a generated token that is a word on its own: the tokenizer writes its text back as it
    word, token = next((tok.decode([t]), t) for t in free.outputs[0].token_ids
                       if tok.decode([t]).strip() and tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    banned_ids = {token}
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, bad_words=[word]), use_tqdm=False)[0]
    assert banned_ids and not banned_ids & set(out.outputs[0].token_ids)
    assert out.outputs[0].token_ids != free.outputs[0].token_ids
