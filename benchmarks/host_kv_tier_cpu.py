"""TTFT of each turn of a multi-turn chat with and without the host KV tier (--kv-offloading-size),
in the same process, engines alternating first per round; medians.

    python benchmarks/host_kv_tier_cpu.py --rounds 3

Workload: one conversation (a system prompt, then per turn a user message appended to the whole
history, a greedy reply of --reply-tokens, the reply appended too: what a chat client sends), and
between two turns one other user's long prompt that needs most of the device cache, so the
conversation's blocks are evicted before its next turn. Model: the Llama-shaped random float32
checkpoint the CPU benchmarks share (hidden 512, 8 layers, 8 / 4 heads, vocab 1024; 16 KiB of KV
per token), or --model PATH. Engines, each on its own device cache of --device-blocks blocks:
  * "device only": prefix caching, no host tier: an evicted history is recomputed;
  * "host tier": the same cache plus --kv-offloading-size GiB of host memory: the history evicted
    between turns comes back by copy (on a CPU machine both tiers are DRAM: the copy is a memcpy);
  * "device, no eviction": a device cache large enough to keep everything (the upper bound).
TTFT is the engine's (first token time - arrival), one request at a time. Every engine must give
the same tokens (checked: the tier is lossless).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model, isa  # noqa: E402
from benchmarks.tp_cpu import ISSUE2_SHAPE  # noqa: E402
from stoker import LLM, SamplingParams  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402


def chat(llm: LLM, args: argparse.Namespace, seed: int) -> tuple[list[float], list[int], list[list[int]]]:
    """One conversation from a cold cache: per turn its TTFT (s), its cached prompt tokens, its reply."""
    llm.reset_prefix_cache()  # both tiers: every round starts cold
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(5, 1000) for _ in range(n)]  # noqa: E731
    history = rand(args.system_tokens)
    reply = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    other = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts, cached, replies = [], [], []
    for _ in range(args.turns):
        history += rand(args.user_tokens)
        out = llm.generate({"prompt_token_ids": history}, reply, use_tqdm=False)[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        cached.append(out.num_cached_tokens)
        replies.append(out.outputs[0].token_ids)
        history += out.outputs[0].token_ids
        llm.generate({"prompt_token_ids": rand(args.other_tokens)}, other, use_tqdm=False)  # another user
    return ttfts, cached, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--other-tokens", type=int, default=1100, help="the other user's prompt between turns")
    ap.add_argument("--device-blocks", type=int, default=80, help="device cache (16-token blocks) of the first two engines")
    ap.add_argument("--kv-offloading-size", type=float, default=0.125, help="GiB of host tier")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()  # removed at exit, also when a run fails
    path = Path(args.model) if args.model else make_tiny_checkpoint(Path(tmp.name) / "m512", "llama", **ISSUE2_SHAPE)
    common = dict(max_model_len=1280, device="cpu", max_num_batched_tokens=2048)
    engines = {
        "device only": LLM(str(path), num_gpu_blocks_override=args.device_blocks, **common),
        "host tier": LLM(str(path), num_gpu_blocks_override=args.device_blocks,
                         kv_offloading_size=args.kv_offloading_size, **common),
        "device, no eviction": LLM(str(path), num_gpu_blocks_override=1024, **common),
    }
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for llm in engines.values():  # kernels built, caches touched
        llm.generate({"prompt_token_ids": list(range(5, 600))}, warm, use_tqdm=False)
    names = list(engines)
    ttft: dict[str, list[list[float]]] = {n: [] for n in names}  # per round, per turn
    cached: dict[str, list[int]] = {}
    replies: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t, cached[name], replies[name] = chat(engines[name], args, seed=1)
            ttft[name].append(t)
            print(f"round {r + 1} {name}: TTFT (ms) {', '.join(f'{1e3 * x:.0f}' for x in t)}", flush=True)
    lossless = all(replies[n] == replies[names[0]] for n in names)
    host = engines["host tier"].engine.stats().host_kv
    per_turn = {n: [statistics.median(run[i] for run in ttft[n]) for i in range(args.turns)] for n in names}
    last = {n: per_turn[n][-1] for n in names}
    later = {n: statistics.median(t for run in ttft[n] for t in run[1:]) for n in names}
    # the least disturbed turn of each engine: on a shared machine a burst of load only ever adds time
    fastest = {n: min(t for run in ttft[n] for t in run[1:]) for n in names}
    print(f"# {cpu_model()} ({isa()}), {platform.machine()}; model {path.name}; {args.turns} turns, rounds {args.rounds}")
    prompt_n = args.system_tokens + args.turns * args.user_tokens + (args.turns - 1) * args.reply_tokens
    print(f"# turn N prompt {prompt_n} tokens; "
          f"device cache {args.device_blocks} blocks; host tier {host.num_blocks} blocks; lossless {lossless}")
    print("| engine | TTFT turn N (median, ms) | TTFT turns 2..N (median, ms) | turns 2..N (fastest, ms) | "
          "cached tokens per turn (last round) |")
    print("|---|---:|---:|---:|---|")
    for n in names:
        print(f"| {n} | {1e3 * last[n]:.0f} | {1e3 * later[n]:.0f} | {1e3 * fastest[n]:.0f} | "
              f"{', '.join(map(str, cached[n]))} |")
    print(f"\nTTFT turn N, device only / host tier: {last['device only'] / last['host tier']:.2f}x; "
          f"turns 2..N: {later['device only'] / later['host tier']:.2f}x (fastest: "
          f"{fastest['device only'] / fastest['host tier']:.2f}x); host tier / no eviction, turn N: "
          f"{last['host tier'] / last['device, no eviction']:.2f}x")
    print("per turn medians (ms): " + "; ".join(f"{n}: {', '.join(f'{1e3 * t:.0f}' for t in per_turn[n])}" for n in names))
    print(f"host tier counters: {host.hit_blocks} of {host.lookup_blocks} blocks looked up hit, {host.saved_blocks} saved "
          f"({host.saved_bytes / 2**20:.1f} MiB), {host.loaded_blocks} loaded ({host.loaded_bytes / 2**20:.1f} MiB)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ttft": ttft, "cached": cached, "lossless": lossless}, indent=1))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
