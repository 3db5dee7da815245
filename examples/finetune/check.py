"""Greedy-decode "PING <n>" with HF transformers, base model vs base + adapter(s) (peft).

Prints a few replies side by side and, per adapter, the fraction answered exactly "PONG <n+1>",
on numbers the training file does not hold (--exclude), so it measures the pattern learned,
not rows remembered. Several adapters (e.g. each checkpoint-N) are scored in one run.

    python examples/finetune/check.py --model tiny-base --adapter pong-adapter --exclude pingpong.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path


def seen_numbers(path: Path) -> set[int]:
    seen = set()
    for line in path.read_text().splitlines():
        for m in json.loads(line)["messages"] if line.strip() else []:
            if m["role"] == "user" and (hit := re.fullmatch(r"PING (\d+)", m["content"])):
                seen.add(int(hit.group(1)))
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", nargs="+", required=True)
    ap.add_argument("--exclude", type=Path, default=None, help="training JSONL whose numbers are not asked")
    ap.add_argument("--num", type=int, default=100)
    ap.add_argument("--max-n", type=int, default=999)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--show", type=int, default=5)
    args = ap.parse_args()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)

    def load_base():
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    def reply(model, n: int) -> str:
        text = tok.apply_chat_template([{"role": "user", "content": f"PING {n}"}], tokenize=False,
                                       add_generation_prompt=True)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    seen = seen_numbers(args.exclude) if args.exclude else set()
    pool = [n for n in range(args.max_n + 1) if n not in seen]
    numbers = random.Random(args.seed).sample(pool, min(args.num, len(pool)))
    base = load_base()
    base_replies = [reply(base, n) for n in numbers]

    def score(replies: list[str]) -> str:
        hits = sum(r == f"PONG {n + 1}" for n, r in zip(numbers, replies))
        shaped = sum(re.fullmatch(r"PONG \d+", r) is not None for r in replies)
        return f"{hits}/{len(numbers)} exactly 'PONG <n+1>', {shaped}/{len(numbers)} of the form 'PONG <number>'"

    print(f"{len(numbers)} numbers{' not in ' + str(args.exclude) if seen else ''}")
    print(f"{'base':>24}: {score(base_replies)}")
    for path in args.adapter:
        tuned = PeftModel.from_pretrained(load_base(), path).eval()
        replies = [reply(tuned, n) for n in numbers]
        print(f"{Path(path).name:>24}: {score(replies)}")
        for n, b, t in list(zip(numbers, base_replies, replies))[: args.show]:
            print(f"    PING {n:<4} base: {b[:28]!r:<32} adapter: {t!r}")


if __name__ == "__main__":
    main()
