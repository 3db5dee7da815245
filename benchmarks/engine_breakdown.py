"""Where one offline run of issue 2's workload spends its time, op by op (CPU).

The engine is not modified: timers wrap `Linear.forward` (split by M: decode-sized, M <= 64,
or prefill-sized, M > 256) and the kernel entry points in `stoker.kernels.ops`; "other" is
the rest of the run (scheduling, input preparation, embedding, sampling, detokenization,
module-call overhead). Also reported: the wall time of steps that carry prompt tokens vs
pure-decode steps. One warm-up run first; the prefix cache is reset before the timed run.

Usage: python benchmarks/engine_breakdown.py [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput_vs_hf import MODEL, make_stoker, workload  # noqa: E402

from stoker import SamplingParams  # noqa: E402
from stoker.kernels import ops  # noqa: E402
from stoker.layers import linear  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

OPS = ("paged_decode_attention", "paged_attention", "fused_add_rms_norm", "rms_norm", "silu_and_mul",
       "rotary_embedding", "store_kvcache")


def instrument(seconds: collections.Counter, flops: collections.Counter) -> None:
    plain_forward = linear.Linear.forward

    def timed_forward(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = plain_forward(self, x)
        m = x.shape[0]
        key = "linear M<=64" if m <= 64 else ("linear 64<M<=256" if m <= 256 else "linear M>256")
        seconds[key] += time.perf_counter() - t
        flops[key] += 2 * m * self.in_features * self.out_features
        return out

    linear.Linear.forward = timed_forward
    for name in OPS:
        fn = getattr(ops, name)

        def timed(*args, _fn=fn, _name=name, **kwargs):
            t = time.perf_counter()
            out = _fn(*args, **kwargs)
            seconds[_name] += time.perf_counter() - t
            return out

        setattr(ops, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reqs = workload()
    num_out = sum(n for _, n in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "m", "llama", **MODEL)
        llm = make_stoker(model_dir, reqs)
        llm.reset_prefix_cache()
        engine = llm.engine
        seconds: collections.Counter = collections.Counter()
        flops: collections.Counter = collections.Counter()
        instrument(seconds, flops)
        for i, (ids, n) in enumerate(reqs):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            engine.add_request(engine.input_processor.process(f"r{i}", None, params, ids))
        schedule = engine.scheduler.schedule
        last: dict = {}

        def recording_schedule(*a, **k):  # remember what each step ran
            last["out"] = schedule(*a, **k)
            return last["out"]

        engine.scheduler.schedule = recording_schedule
        steps = {"prefill": [0, 0.0], "decode": [0, 0.0]}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            last.clear()
            t = time.perf_counter()
            engine.step()
            out = last["out"]
            kind = "prefill" if out.num_batched_tokens > len(out.scheduled) else "decode"
            steps[kind][0] += 1
            steps[kind][1] += time.perf_counter() - t
        total = time.perf_counter() - start
        engine.check_integrity()
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "total_s": total,
        "output_tokens_per_s": num_out / total,
        "steps": {k: {"num": v[0], "seconds": v[1]} for k, v in steps.items()},
        "seconds": dict(seconds.most_common()),
        "other_s": total - sum(seconds.values()),
        "linear_gflops": {k: flops[k] / seconds[k] / 1e9 for k in flops},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
