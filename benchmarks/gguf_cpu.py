"""GGUF files on CPU: batch-1 decode of llama.cpp's k-quant mixes against uniform files.

    python benchmarks/gguf_cpu.py [--repeats 3] [--steps 32] [--files Q4_K_M,...] [--threads N]
        [--activation-dtype int8] [--json out.json]

The ~0.4B Llama-shaped random model of benchmarks/quantized_cpu.py part 5 (hidden 1024, 28
layers, GQA 16/4, intermediate 2816, vocab 32000) written as GGUF files
(stoker/testing/gguf_checkpoint.py), each tensor typed as llama.cpp's llama-quantize types it
(`llama_cpp_types`):

  Q4_K_M   Q4_K projections; attn_v and ffn_down of 11 of the 28 layers Q6_K (so those layers'
           q/k/v run as a composite: an int4 GEMM for q/k, an int8 one for v), output Q6_K,
           token_embd Q4_K (held as floats: rows are gathered)
  Q5_K_M   the same with Q5_K (affine int8) for Q4_K
  Q4_K     every projection and the output Q4_K (one int4 GEMM per merged layer)
  Q8_0     every projection and the output Q8_0
  Q4_0     every projection Q4_0, the output Q6_K (llama-quantize's Q4_0 mix)

`--activation-dtype int8` loads every file with int8 activations (W4A8 for the int4
projections, as `stoker serve --activation-dtype int8`); `--threads` sets torch's threads (the
C kernels use the same count). "CPU ms a step" is the median process CPU time of the measured
steps: on a shared machine it leaves out the waits (the JSON also keeps the fastest step's,
`cpu_ms_per_step_min`, the least disturbed by other jobs).

All loaded in one process, interleaved per repeat; a 64-token prompt, the median of `steps`
pure-decode engine steps per repeat (benchmarks/quantized_cpu.decode_steps), the median of the
repeats. "weight MB held" is the runner's byte count (codes, scales, offsets, float embedding).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantized_cpu import INT4_DECODE_MODEL, decode_steps  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from stoker import LLM  # noqa: E402
from stoker.kernels.cpu import linear as cpu_linear  # noqa: E402
from stoker.testing.gguf_checkpoint import llama_cpp_types, write_gguf  # noqa: E402
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer, make_tiny_checkpoint  # noqa: E402

LAYERS = INT4_DECODE_MODEL["num_hidden_layers"]
FILES = {
    "Q4_K_M": llama_cpp_types("Q4_K_M", LAYERS),
    "Q5_K_M": llama_cpp_types("Q5_K_M", LAYERS),
    "Q4_K": {r"proj\.weight|lm_head|embed_tokens": "Q4_K"},
    "Q8_0": {r"proj\.weight|lm_head|embed_tokens": "Q8_0"},
    "Q4_0": {r"lm_head": "Q6_K", r"proj\.weight|embed_tokens": "Q4_0"},
}


def composite_layers(llm: LLM) -> int:
    from stoker.layers.composite_method import CompositeLinearMethod

    return sum(isinstance(getattr(m, "method", None), CompositeLinearMethod) for m in llm.engine.executor.driver_runner.model.modules())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--files", default="Q4_K_M,Q5_K_M,Q4_K,Q8_0", help="comma-separated subset of " + ", ".join(FILES))
    ap.add_argument("--activation-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = args.files.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    out: dict = {"machine": f"{cpu_model()}, ISA build {cpu_linear.target()}, {torch.get_num_threads()} threads",
                 "torch": torch.__version__, "repeats": args.repeats, "model": INT4_DECODE_MODEL,
           "activation_dtype": args.activation_dtype}
    print(f"# {out['machine']}; torch {torch.__version__}; medians of {args.repeats} interleaved repeats")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = make_tiny_checkpoint(tmp / "hf", "llama", **INT4_DECODE_MODEL)
        llms = {}
        for name in names:
            (tmp / name).mkdir()
            path = write_gguf(src, tmp / name / "model.gguf", FILES[name], "llama", with_tokenizer=False)
            copy_demo_tokenizer(tmp / name)
            llms[name] = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=4,
                             activation_dtype=args.activation_dtype)
            gc.collect()
        held = {n: llm.engine.executor.driver_runner.weight_bytes_held() for n, llm in llms.items()}
        composite = {n: composite_layers(llm) for n, llm in llms.items()}
        times: dict[str, list[float]] = {n: [] for n in llms}
        cpu: dict[str, list[float]] = {n: [] for n in llms}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                times[name].append(decode_steps(llm, 1, input_len=64, steps=args.steps, cpu_times=cpu[name]))
    base = statistics.median(times[names[-1]])
    rows = []
    print(f"\n| file | tokens/s | vs {names[-1]} | step ms | CPU ms a step | weight MB held | composite layers "
          "| per repeat (tokens/s) |\n|---|---:|---:|---:|---:|---:|---:|---|")
    for name, t in times.items():
        sec = statistics.median(t)
        row = {"file": name, "tokens_per_s": 1 / sec, "ratio": base / sec, "step_ms": sec * 1e3,
               "cpu_ms_per_step": statistics.median(cpu[name]) * 1e3,
               # the fastest step: on a shared machine, the least disturbed one
               "cpu_ms_per_step_min": min(cpu[name]) * 1e3,
               "weight_MB_held": held[name] / 1e6, "composite_layers": composite[name],
               "per_repeat_tokens_per_s": [round(1 / x, 1) for x in t]}
        rows.append(row)
        print(f"| {name} | {row['tokens_per_s']:.1f} | {row['ratio']:.2f}x | {row['step_ms']:.1f} | {row['cpu_ms_per_step']:.1f} | "
              f"{row['weight_MB_held']:.0f} | {row['composite_layers']} | {row['per_repeat_tokens_per_s']} |")
    out["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
