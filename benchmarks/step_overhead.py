"""Where an engine step's time goes: schedule / prepare_inputs / forward / logits / sample /
post-process, medians over pure-decode steps, per batch size.

    python benchmarks/step_overhead.py                           # tiny random llama, CPU or CUDA (auto)
    python benchmarks/step_overhead.py --shape small --device cpu
    python benchmarks/step_overhead.py --model /path/to/ckpt --device cuda --batch-sizes 1 8 32 64
    python benchmarks/step_overhead.py --shape llama3-8b --device cuda   # builds an 8B-shaped random
                                                                         # bf16 checkpoint first (minutes)
    ... --enforce-eager      # decode without CUDA graphs;   --json out.json
    ... --quantization fp8 --kv-cache-dtype fp8     # issue 13: FP8 weights and KV cache

The engine is not modified: the script wraps, on one engine instance, Scheduler.schedule,
runner.execute, inputs.prepare_inputs, the model forward (or the CUDA-graph replay), the
LM head (compute_logits) and the Sampler, and times each call with perf_counter (host wall
time of the stepping thread). post-process = step - schedule - execute: the scheduler's
bookkeeping after the step, appending tokens, detokenizing, stop checks, building outputs.
runner other = execute - (prepare + forward + logits + sample): SamplingRow building etc.

On CUDA, kernels run asynchronously, so the forward wrapper records CUDA events around the
forward and then synchronises: `forward` is the host time to launch it (or to fill the
static buffers and replay the graph), `forward GPU` the device time between the events, and
the other phases are not charged for waiting on the forward. (The step itself already syncs
once, when the sampler reads the sampled ids, so the extra sync moves the wait rather than
adding one.) On CPU, `forward` is the compute.

Workload: each batch size B gets B requests of --input-len random prompt tokens and
--output-len tokens each (greedy, ignore_eos), admitted together; only steps in which every
scheduled sequence decodes (one new token) are summarised, after --warmup such steps.
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
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stoker.runner.model_runner as model_runner_module  # noqa: E402
from stoker import LLM, SamplingParams  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},  # stoker.testing.tiny_checkpoint.TINY: hidden 64, 2 layers: the step is almost all overhead
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),  # benchmarks/throughput_vs_hf.py's model
    # Llama-3-8B's body; vocab kept at the demo tokenizer's 1024 (the real LM head is 128256 wide).
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192),
}
PHASES = ["schedule", "prepare_inputs", "forward", "forward_gpu", "logits", "sample", "runner_other", "post_process", "step"]


class StepTimer:
    """Wraps the engine's parts in place and collects per-step phase times (ms)."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.runner = llm.engine.executor.driver_runner
        self.is_cuda = self.runner.device.type == "cuda"
        self.current: dict[str, float] = defaultdict(float)
        self._wrap(self.engine.scheduler, "schedule", "schedule")
        self._wrap(self.runner, "execute", "execute")
        self._wrap(self.runner.model, "compute_logits", "logits")
        self._wrap(self.runner, "sampler", "sample", self.runner.sampler)
        self._wrap_forward(self.runner.model, "forward")
        if self.runner.graph_runner is not None:
            self._wrap_forward(self.runner.graph_runner, "run")
        original_prepare = model_runner_module.prepare_inputs
        self._restore = lambda: setattr(model_runner_module, "prepare_inputs", original_prepare)
        model_runner_module.prepare_inputs = self._timed(original_prepare, "prepare_inputs")

    def close(self) -> None:
        self._restore()

    def _timed(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += (time.perf_counter() - t0) * 1e3

        return timed

    def _wrap(self, obj: Any, attr: str, phase: str, fn: Callable[..., Any] | None = None) -> None:
        setattr(obj, attr, self._timed(fn or getattr(obj, attr), phase))

    def _wrap_forward(self, obj: Any, attr: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.current["forward"] += (time.perf_counter() - t0) * 1e3
            if self.is_cuda:
                end.record()
                end.synchronize()
                self.current["forward_gpu"] += start.elapsed_time(end)
            return out

        setattr(obj, attr, timed)

    def step(self) -> tuple[dict[str, float], bool]:
        """One engine step -> (phase times in ms, whether it was a pure-decode step)."""
        self.current = defaultdict(float)
        pure_decode: list[bool] = []
        schedule = self.engine.scheduler.schedule

        def schedule_and_classify() -> Any:
            out = schedule()
            pure_decode.append(bool(out.scheduled) and all(s.num_tokens == 1 for s in out.scheduled))
            return out

        self.engine.scheduler.schedule = schedule_and_classify
        t0 = time.perf_counter()
        try:
            self.engine.step()
        finally:
            self.engine.scheduler.schedule = schedule
        times = dict(self.current)
        times["step"] = (time.perf_counter() - t0) * 1e3
        inner = sum(times.get(k, 0.0) for k in ("prepare_inputs", "forward", "logits", "sample"))
        times["runner_other"] = times.get("execute", 0.0) - inner
        times["post_process"] = times["step"] - times.get("schedule", 0.0) - times.get("execute", 0.0)
        return times, pure_decode[0]


def run_batch(llm: LLM, timer: StepTimer, batch_size: int, input_len: int, output_len: int, warmup: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = llm.engine.hf_config["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch_size):
        ids = [rng.randrange(5, vocab) for _ in range(input_len)]
        llm.engine.add_request(llm.engine.input_processor.process(f"b{batch_size}-{i}", None, params, ids))
    decode_steps: list[dict[str, float]] = []
    seen = 0
    while llm.engine.has_unfinished_requests():
        times, pure_decode = timer.step()
        if pure_decode and len(llm.engine.scheduler.running) == batch_size:
            seen += 1
            if seen > warmup:
                decode_steps.append(times)
    llm.engine.check_integrity()
    medians = {p: statistics.median(s.get(p, 0.0) for s in decode_steps) for p in PHASES} if decode_steps else {}
    return {"batch_size": batch_size, "decode_steps": len(decode_steps), "median_ms": medians}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory; default: a random checkpoint of --shape")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3, help="pure-decode steps skipped per batch size")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", choices=["fp8", "int8"], default=None, help="quantize the weights at load")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU runs)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            dtype = "bfloat16" if args.shape == "llama3-8b" else "float32"
            model = str(make_tiny_checkpoint(Path(tmp) / args.shape, "llama", dtype=dtype, **SHAPES[args.shape]))
        max_model_len = args.input_len + args.output_len
        kv_bytes = args.kv_cache_memory_bytes
        llm = LLM(model, device=args.device, dtype=args.dtype, max_model_len=max_model_len,
                  max_num_seqs=max(args.batch_sizes), kv_cache_memory_bytes=kv_bytes, enforce_eager=args.enforce_eager,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        runner = llm.engine.executor.driver_runner
        graphs = runner.graph_runner is not None
        timer = StepTimer(llm)
        try:
            results = [run_batch(llm, timer, b, args.input_len, args.output_len, args.warmup, seed=b) for b in sorted(args.batch_sizes)]
        finally:
            timer.close()

    machine = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
    print(f"# step overhead: model {args.model or args.shape}, {runner.device} ({machine}), {str(runner.dtype).removeprefix('torch.')}, "
          f"weights {args.quantization or 'unquantized'}, KV {runner.kv_spec.dtype}, "
          f"CUDA graphs {'on' if graphs else 'off'}, input {args.input_len}, output {args.output_len}; median ms over pure-decode steps")
    cols = ["B", "steps"] + PHASES + ["host %"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        m = r["median_ms"]
        if not m:
            print(f"| {r['batch_size']} | 0 |" + " - |" * (len(cols) - 2))
            continue
        # Host share: on CUDA, step time not covered by the GPU's forward; on CPU, non-forward time.
        busy = m["forward_gpu"] if runner.device.type == "cuda" else m["forward"]
        host = 100 * max(0.0, m["step"] - busy) / m["step"]
        cells = [str(r["batch_size"]), str(r["decode_steps"])]
        cells += ["-" if p == "forward_gpu" and runner.device.type != "cuda" else f"{m[p]:.3f}" for p in PHASES]
        cells.append(f"{host:.0f}")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": str(runner.device), "machine": machine,
                                               "dtype": str(runner.dtype), "cuda_graphs": graphs, "results": results}, indent=2))


if __name__ == "__main__":
    main()
