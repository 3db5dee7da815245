"""Prompt sets: exact token lengths with a tokenizer, estimates without, file formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.bench.datasets import DatasetOptions, sample_requests
from stoker.bench.tokenizer import load_tokenizer


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1}
    for i, w in enumerate(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"], start=2):
        vocab[w] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_random_without_tokenizer_is_seeded_and_word_counted() -> None:
    opts = DatasetOptions(num_prompts=20, input_len=50, output_len=7, range_ratio=0.2, seed=3)
    a = sample_requests(opts)
    assert a == sample_requests(opts)
    assert len(a) == 20
    for spec in a:
        assert 40 <= spec.prompt_len <= 60 and spec.prompt_len == len(spec.prompt.split())
        assert 5 <= spec.max_tokens <= 9


def test_random_with_tokenizer_has_exact_lengths_and_shared_prefix(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    assert 1 not in tok.usable_ids()  # special tokens never appear in random prompts
    opts = DatasetOptions(num_prompts=10, input_len=30, output_len=4, range_ratio=0.5, prefix_len=5)
    specs = sample_requests(opts, tok)
    prefixes = {" ".join(s.prompt.split()[:5]) for s in specs}
    assert len(prefixes) == 1
    for s in specs:
        assert len(tok.encode(s.prompt)) == s.prompt_len
        assert 5 + 15 <= s.prompt_len <= 5 + 45


def test_sharegpt(tmp_path: Path) -> None:
    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    data = [conv("x" * 40, "y" * 80), conv("hi", "yo"), {"conversations": [{"value": "lonely"}]},
            conv("q" * 100, "a" * 60)]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(data))
    specs = sample_requests(DatasetOptions(spec=f"sharegpt:{f}", num_prompts=5))
    assert len(specs) == 5  # two usable conversations, cycled
    assert {(s.prompt_len, s.max_tokens) for s in specs} == {(10, 20), (25, 15)}
    fixed = sample_requests(DatasetOptions(spec=f"sharegpt:{f}", num_prompts=2, sharegpt_output_len=64))
    assert {s.max_tokens for s in fixed} == {64}


def test_jsonl(tmp_path: Path, tokenizer_dir: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "alpha beta gamma", "output_len": 3}\n\n{"prompt": "delta", "max_tokens": 9}\n'
                 '{"prompt": "eta"}\n')
    specs = sample_requests(DatasetOptions(spec=f"jsonl:{f}", num_prompts=3, output_len=5),
                            load_tokenizer(str(tokenizer_dir / "tokenizer.json")))
    assert [(s.prompt, s.prompt_len, s.max_tokens) for s in specs] == [
        ("alpha beta gamma", 3, 3), ("delta", 1, 9), ("eta", 1, 5)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="line 1"):
        sample_requests(DatasetOptions(spec=f"jsonl:{bad}", num_prompts=1))


@pytest.mark.parametrize("kwargs, flag", [
    (dict(spec="csv:x"), "--dataset"), (dict(spec="sharegpt"), "--dataset"),
    (dict(num_prompts=0), "--num-prompts"), (dict(range_ratio=1.0), "--random-range-ratio"),
    (dict(prefix_len=-1), "--random-prefix-len"), (dict(input_len=0), "--random-input-len"),
])
def test_invalid_options(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        sample_requests(DatasetOptions(**kwargs))


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        sample_requests(DatasetOptions(spec=f"jsonl:{tmp_path / 'nope.jsonl'}"))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))


def test_exact_lengths_with_byte_level_bpe() -> None:
    """The bundled demo tokenizer (byte-level BPE) round-trips random ids imperfectly."""
    from importlib import resources

    path = Path(str(resources.files("stoker") / "assets" / "demo_tokenizer"))
    if not (path / "tokenizer.json").is_file():
        pytest.skip("no bundled demo tokenizer in this checkout")
    tok = load_tokenizer(str(path))
    specs = sample_requests(DatasetOptions(num_prompts=20, input_len=100, range_ratio=0.5, prefix_len=8), tok)
    for s in specs:
        assert len(tok.encode(s.prompt)) == s.prompt_len and 58 <= s.prompt_len <= 158
