"""Write the PING/PONG chat dataset of docs/finetune.md: "PING <n>" -> "PONG <n+1>".

A pattern no base model produces on its own (it must learn the word and the increment), small
enough that a tiny model learns it on a CPU in minutes. Numbers are drawn without replacement,
so the held-out rows (--eval-split, and check.py's fresh numbers) are ones the model never saw.

    python examples/finetune/make_data.py --rows 400 --max-n 999 --out pingpong.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def rows(num_rows: int, max_n: int, seed: int) -> list[dict]:
    if num_rows > max_n + 1:
        raise ValueError(f"--rows {num_rows} is more than the {max_n + 1} distinct numbers 0..{max_n}")
    numbers = random.Random(seed).sample(range(max_n + 1), num_rows)
    return [{"messages": [{"role": "user", "content": f"PING {n}"},
                          {"role": "assistant", "content": f"PONG {n + 1}"}]} for n in numbers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--max-n", type=int, default=999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("pingpong.jsonl"))
    args = ap.parse_args()
    data = rows(args.rows, args.max_n, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in data))
    print(f"wrote {len(data)} rows to {args.out}")


if __name__ == "__main__":
    main()
