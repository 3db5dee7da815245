"""Prompt sets for `bench serve`: `random`, `sharegpt:PATH`, `jsonl:PATH`.

With `--tokenizer` prompt lengths are exact token counts; without one they are estimates
(random prompts use short common words, ~1 token each in BPE vocabularies; other text is
counted at ~4 characters per token) and the report prefers the server's
`usage.prompt_tokens` whenever it is sent.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from stoker.bench.client import RequestSpec
from stoker.bench.tokenizer import BenchTokenizer

# Common short words; with a leading space each is a single token in GPT-2, Llama and Qwen
# style BPE vocabularies, so word count is a good estimate of prompt tokens.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could people "
    "my than first water been call who oil its now find long down day did get come made may "
    "part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much "
    "before line right too mean old any same tell boy follow came want show also around form "
    "three small set put end does another well large must big even such because turn here"
).split()


@dataclass(frozen=True)
class DatasetOptions:
    spec: str = "random"
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    sharegpt_output_len: int | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0:
            raise ValueError(f"--random-prefix-len must be >= 0, got {self.prefix_len}")
        kind = self.spec.split(":", 1)[0]
        if kind not in ("random", "sharegpt", "jsonl") or (kind != "random" and ":" not in self.spec):
            raise ValueError(f"--dataset must be random, sharegpt:PATH or jsonl:PATH; got {self.spec!r}")


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / 4))


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _exact_ids(tok: BenchTokenizer, rng: random.Random, pool: list[int], head: list[int],
               target: int) -> tuple[str, int]:
    """Text whose re-encoding is `target` tokens and starts with `head` (the shared prefix).

    Decoding random ids and re-encoding rarely round-trips (merges across boundaries), so
    trim or top up the tail and try again, a bounded number of times.
    """
    ids = head + [rng.choice(pool) for _ in range(target - len(head))]
    best_text, best_n = tok.decode(ids), -1
    for _ in range(16):
        text = tok.decode(ids)
        enc = tok.encode(text)
        n = len(enc)
        if best_n < 0 or abs(n - target) < abs(best_n - target):
            best_text, best_n = text, n
        if n == target:
            break
        ids = enc[:target] if n > target else enc + [rng.choice(pool) for _ in range(target - n)]
    return best_text, best_n  # the closest found; its true length is what gets reported


def random_requests(opts: DatasetOptions, tok: BenchTokenizer | None) -> list[RequestSpec]:
    rng = random.Random(opts.seed)
    in_lens = _lengths(rng, opts.input_len, opts.range_ratio, opts.num_prompts)
    out_lens = _lengths(rng, opts.output_len, opts.range_ratio, opts.num_prompts)
    specs: list[RequestSpec] = []
    if tok is None:
        prefix = [rng.choice(_WORDS) for _ in range(opts.prefix_len)]
        for n_in, n_out in zip(in_lens, out_lens):
            words = prefix + [rng.choice(_WORDS) for _ in range(n_in)]
            specs.append(RequestSpec(" ".join(words), len(words), n_out))
        return specs
    pool = tok.usable_ids()
    prefix_ids = [rng.choice(pool) for _ in range(opts.prefix_len)]
    for n_in, n_out in zip(in_lens, out_lens):
        text, n = _exact_ids(tok, rng, pool, prefix_ids, opts.prefix_len + n_in)
        specs.append(RequestSpec(text, n, n_out))
    return specs


def _cycle(items: list[RequestSpec], n: int) -> list[RequestSpec]:
    if not items:
        raise ValueError("the dataset has no usable prompts (check the file and its format)")
    return [items[i % len(items)] for i in range(n)]


def sharegpt_requests(path: Path, opts: DatasetOptions, tok: BenchTokenizer | None) -> list[RequestSpec]:
    count = tok.count if tok is not None else estimate_tokens
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"--dataset sharegpt:{path}: expected a JSON list of conversations")
    rng = random.Random(opts.seed)
    rng.shuffle(data)
    specs: list[RequestSpec] = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        n_in = count(prompt)
        n_out = opts.sharegpt_output_len or count(answer)
        # The filters vLLM applies to ShareGPT: drop tiny and over-long conversations.
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        specs.append(RequestSpec(prompt, n_in, n_out))
        if len(specs) == opts.num_prompts:
            break
    return _cycle(specs, opts.num_prompts)


def jsonl_requests(path: Path, opts: DatasetOptions, tok: BenchTokenizer | None) -> list[RequestSpec]:
    """One JSON object per line: {"prompt": str, "output_len"|"max_tokens": int (optional)}."""
    count = tok.count if tok is not None else estimate_tokens
    specs: list[RequestSpec] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--dataset jsonl:{path} line {lineno}: expected {{\"prompt\": ...}}") from None
        n_out = int(obj.get("output_len") or obj.get("max_tokens") or opts.output_len)
        specs.append(RequestSpec(str(prompt), count(str(prompt)), n_out))
        if len(specs) == opts.num_prompts:
            break
    return _cycle(specs, opts.num_prompts)


def sample_requests(opts: DatasetOptions, tok: BenchTokenizer | None = None) -> list[RequestSpec]:
    """The run's requests, in send order. Deterministic for a given seed."""
    opts.validate()
    kind, _, path = opts.spec.partition(":")
    if kind == "random":
        return random_requests(opts, tok)
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--dataset {opts.spec}: no such file {path}")
    if kind == "sharegpt":
        return sharegpt_requests(file, opts, tok)
    return jsonl_requests(file, opts, tok)
