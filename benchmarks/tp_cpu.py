"""Tensor parallelism on CPU (gloo): what the message boundary costs at TP=1, and the all-reduces
of each TP=2 step measured against the roofline's collective model.

    python benchmarks/tp_cpu.py                      # issue 2's model shape, B = 1, 8, 32
    python benchmarks/tp_cpu.py --batch-sizes 1 8 --json out.json

1. TP=1: the engine builds a StepMessage from the scheduler's plan every step
   (`core/step.build_step`), where it used to hand the runner the plan itself. Its time is
   measured around every call, beside the whole step's, over pure-decode steps (medians): the
   share of a decode step the boundary costs.
   KV capacity: blocks at the same per-rank KV budget, TP=1 vs TP=2.
2. TP=2 (this process is rank 0, one worker process; the 2 cores shared): per pure-decode
   step, the wall time of the step, of the control broadcast, and of the all-reduces (gloo,
   timed around each call), beside the alpha-beta model fitted at start-up from a 4 KiB - 1 MiB
   all-reduce microbenchmark (never from the steps): the step's messages (B x hidden x 4 bytes)
   are sizes the fit did not see. TP=1's step time on the same workload is the peer.

Workload: B requests of --input-len random prompt tokens, --output-len tokens each (greedy,
ignore_eos), admitted together. Model: issue 2's shape (hidden 512, intermediate 1408, 8
layers, 8 heads / 4 KV heads, vocab 1024), random float32 weights.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stoker.engine.llm_engine as llm_engine_module  # noqa: E402
from benchmarks.machine import cpu_model, isa  # noqa: E402
from stoker import LLM, SamplingParams  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

ISSUE2_SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 4, "max_position_embeddings": 2048}


def decode_steps(llm: LLM, batch: int, input_len: int, output_len: int, seed: int) -> dict[str, list[float]]:
    """Run one batch; per pure-decode step: step ms, build_step ms, broadcast ms, all-reduce ms
    measured and modelled."""
    engine = llm.engine
    executor = engine.executor
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"step": [], "build_step": [], "broadcast": [], "allreduce": [], "modelled": []}
    current: dict[str, Any] = {}
    real_build = llm_engine_module.build_step

    def timed_build(out: Any, eos: Any, *rest: Any) -> Any:
        start = time.perf_counter()
        msg = real_build(out, eos, *rest)
        current["build"] = time.perf_counter() - start
        current["decode"] = all(len(s.token_ids) == 1 for s in msg.seqs)
        return msg

    tp = getattr(executor, "tp", None)
    real_broadcast = tp.broadcast_object if tp is not None else None

    def timed_broadcast(obj: Any = None) -> Any:
        start = time.perf_counter()
        out = real_broadcast(obj)
        current["broadcast"] = current.get("broadcast", 0.0) + time.perf_counter() - start
        return out

    llm_engine_module.build_step = timed_build
    if tp is not None:
        tp.broadcast_object = timed_broadcast
    try:
        for i in range(batch):
            ids = [rng.randrange(5, 1000) for _ in range(input_len)]
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(engine.input_processor.process(f"b{batch}-{i}", None, params, ids))
        monitor = getattr(executor, "collectives", None)
        while engine.has_unfinished_requests():
            current.clear()
            before = (monitor.measured_s, monitor.predicted_s) if monitor else (0.0, 0.0)
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            if current.get("decode"):
                times["step"].append(elapsed * 1e3)
                times["build_step"].append(current["build"] * 1e3)
                times["broadcast"].append(current.get("broadcast", 0.0) * 1e3)
                if monitor:
                    times["allreduce"].append((monitor.measured_s - before[0]) * 1e3)
                    times["modelled"].append((monitor.predicted_s - before[1]) * 1e3)
    finally:
        llm_engine_module.build_step = real_build
        if tp is not None:
            tp.broadcast_object = real_broadcast
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    tmp_dir = tempfile.TemporaryDirectory()  # removed at exit, also when a run fails
    tmp = Path(tmp_dir.name)
    path = make_tiny_checkpoint(tmp / "m512", "llama", **ISSUE2_SHAPE)
    kw = {"kv_cache_memory_bytes": 1 << 28, "max_model_len": 1024, "max_num_seqs": 64}
    rows = []
    results: dict[str, Any] = {}
    for tp_size in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp_size, **kw)
        results[f"tp{tp_size}_kv_blocks"] = llm.engine.block_manager.num_blocks  # same per-rank budget
        if tp_size == 2:
            link = llm.engine.executor.collectives.model
            results["fit"] = {"alpha_us": link.alpha_s * 1e6, "beta_gb_s": link.beta_bytes_per_s / 1e9}
        for b in args.batch_sizes:
            decode_steps(llm, b, args.input_len, 4, seed=b)  # warm-up at this shape
            t = decode_steps(llm, b, args.input_len, args.output_len, seed=100 + b)
            med = {k: statistics.median(v) if v else 0.0 for k, v in t.items()}
            results[f"tp{tp_size}_b{b}"] = {**med, "steps": len(t["step"])}
            rows.append((tp_size, b, len(t["step"]), med))
        llm.shutdown()

    print(f"# tensor parallelism on CPU: {cpu_model()} ({isa()}), {platform.machine()}, medians over pure-decode steps, "
          f"issue-2 model shape, input {args.input_len}, output {args.output_len}")
    if "fit" in results:
        f = results["fit"]
        print(f"# gloo all-reduce fit (4 KiB-1 MiB microbenchmark): alpha {f['alpha_us']:.1f} us, beta {f['beta_gb_s']:.2f} GB/s")
    print(f"# KV blocks at the same per-rank budget ({kw['kv_cache_memory_bytes'] >> 20} MiB): TP=1 {results['tp1_kv_blocks']}, "
          f"TP=2 {results['tp2_kv_blocks']} (each rank holds half the KV heads)")
    print("| TP | B | steps | step ms | build_step ms (share) | broadcast ms | all-reduce ms measured | modelled | measured / modelled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp_size, b, n, m in rows:
        ratio = f"{m['allreduce'] / m['modelled']:.2f}" if m["modelled"] else "-"
        print(f"| {tp_size} | {b} | {n} | {m['step']:.3f} | {m['build_step']:.4f} ({100 * m['build_step'] / m['step']:.2f}%) | "
              f"{m['broadcast']:.3f} | {m['allreduce']:.3f} | {m['modelled']:.3f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
