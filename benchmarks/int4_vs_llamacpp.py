"""Batch-1 decode, Stoker's 4-bit, 8-bit and float32 weights beside llama.cpp (issue 34).

    python benchmarks/int4_vs_llamacpp.py --llama-cpp BUILD --llama-cpp-src SRC \
        [--threads 1,2] [--repeats 5] [--workdir DIR] [--json out.json]

BUILD: a cmake build of the llama-cpp-python sdist's vendored llama.cpp tree holding
bin/llama-bench and bin/llama-quantize; SRC: that tree (convert_hf_to_gguf.py, gguf-py).

The model is benchmarks/quantized_cpu.py's part-5 ~0.4B Llama (hidden 1024, 28 layers, GQA
16/4, intermediate 2816, vocab 32000), random weights, written once as a float32 HF checkpoint,
then: convert_hf_to_gguf.py --outtype f16, and llama-quantize to Q4_0, Q4_K_M and Q8_0. The demo
tokenizer is a Llama-3-style byte-level BPE the converter has no hash for, so it is told
"llama-bpe" (the token strings do not change decode speed); sentencepiece, which the converter
imports before it looks for a tokenizer.model, is stubbed when not installed.

Peers, all in this process or spawned from it, interleaved: per repeat and thread count, every
Stoker configuration (the median engine step of 32 batch-1 decode steps after a 64-token
prompt: quantized_cpu.decode_steps, contexts 65 to 96) and then, on every file,
`llama-bench -d 64 -n 32 -r 1` (tokens/s of 32 tokens generated after a 64-token context: the
same contexts, the ratios' peer) and `llama-bench -p 0 -n 64 -r 1` (64 tokens from an empty
context, llama-bench's usual test, shown beside it). Reported: the median over repeats, and for Stoker the median
process CPU time of a step (on a shared machine the wall time also holds the waits for a core;
the CPU time does not, though memory contention still inflates it). Stoker runs:
float32 and --quantization int8 on the HF checkpoint, int4 W4A16 groups of 32 (a
compressed-tensors checkpoint written from it: float32 scales), and the Q4_0 and Q8_0 GGUF
files themselves (Stoker's GGUF loader: Q4_0 is int4 groups of 32 with float16 scales, the LM
head is the file's Q6_K, int8 groups of 16), the Q4_0 file again with `--activation-dtype int8`
(W4A8: the int4 projections take int8 activations per block of 32, as llama.cpp's Q4_0 x Q8_0
does, and the Q6_K head runs W6A8 in Q6_K's own 6-bit codes), the Q4_K_M file with it too (its
Q6_K v and down W6A8 as well), and the Q4_0 W4A8 engine once more with
`enforce_eager=True`, whose decode steps run module by module instead of as one C call
(runner/cpu_decode.py): the fused step's gain, measured in the same run.

On this project's machine (the lead's llama.cpp build; a quiet machine makes the ratios mean
something, `uptime` before and after):

    .venv/bin/python benchmarks/int4_vs_llamacpp.py --llama-cpp /work/llamacpp/build \
        --llama-cpp-src /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --repeats 3 --threads 1 --workdir /tmp/int4-bench --json int4.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantized_cpu import INT4_DECODE_MODEL, decode_steps  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from stoker import LLM  # noqa: E402
from stoker.kernels.cpu import linear as cpu_linear  # noqa: E402
from stoker.testing.quantized_checkpoint import quantize_checkpoint  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

GGUF_TYPES = ("Q4_0", "Q4_K_M", "Q8_0")
# Run by the converter's interpreter: the BPE pre-tokenizer named, sentencepiece stubbed if absent.
_CONVERT = textwrap.dedent("""
    import importlib.machinery, importlib.util, runpy, sys, types
    src = sys.argv.pop(1)
    sys.path[:0] = [src, src + "/gguf-py"]
    if importlib.util.find_spec("sentencepiece") is None:
        import transformers  # noqa: F401  (its import-time availability checks must not meet the stub)
        stub = types.ModuleType("sentencepiece")
        stub.SentencePieceProcessor = object
        stub.__spec__ = importlib.machinery.ModuleSpec("sentencepiece", None)  # transformers find_spec()s it
        sys.modules["sentencepiece"] = stub
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
    sys.argv[0] = src + "/convert_hf_to_gguf.py"
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def make_gguf_files(work: Path, build: Path, src: Path, types: tuple[str, ...] | list[str] = GGUF_TYPES) -> dict[str, Path]:
    """The float32 HF checkpoint and its GGUF files of `types` (reused when already in `work`)."""
    hf = work / "hf"
    if not (hf / "config.json").exists():
        make_tiny_checkpoint(hf, "llama", **INT4_DECODE_MODEL)
    files = {"hf": hf}
    f16 = work / "f16.gguf"
    if not f16.exists():
        subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(hf), "--outtype", "f16", "--outfile", str(f16)],
                       check=True, capture_output=True)
    for t in types:
        files[t] = work / f"{t}.gguf"
        if not files[t].exists():
            subprocess.run([str(build / "bin" / "llama-quantize"), str(f16), str(files[t]), t], check=True, capture_output=True)
    return files


def make_files(work: Path, build: Path, src: Path) -> dict[str, Path]:
    """The HF checkpoint, its W4A16 copy and the GGUF files (reused when already in `work`)."""
    files = make_gguf_files(work, build, src)
    files["w4a16"] = work / "w4a16-g32"
    if not (files["w4a16"] / "config.json").exists():
        quantize_checkpoint(files["hf"], files["w4a16"], "ct-w4a16-group")  # groups of 32, symmetric
    return files


# llama-bench's tests: (depth, tokens generated). (64, 32) decodes at Stoker's contexts (65-96).
LLAMA_TESTS = {"d64 n32": ("64", "32"), "n64": ("0", "64")}


def llama_bench(build: Path, model: Path, threads: int, test: str = "d64 n32") -> float:
    """tokens/s of one llama-bench run generating tokens at batch 1 (LLAMA_TESTS[test])."""
    depth, n = LLAMA_TESTS[test]
    out = subprocess.run([str(build / "bin" / "llama-bench"), "-m", str(model), "-p", "0", "-d", depth, "-n", n,
                          "-t", str(threads), "-r", "1", "-o", "json"], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp build dir (bin/llama-bench, bin/llama-quantize)")
    ap.add_argument("--llama-cpp-src", required=True, type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path, help="keep the checkpoints here (default: a temporary folder)")
    ap.add_argument("--json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as d:
        work = args.workdir or Path(d)
        work.mkdir(parents=True, exist_ok=True)
        files = make_files(work, args.llama_cpp, args.llama_cpp_src)
        # name -> (checkpoint, quantization, activation_dtype, enforce_eager: the module-by-module step)
        configs = {"float32": (files["hf"], None, "auto", False), "int8 (--quantization int8)": (files["hf"], "int8", "auto", False),
                   "int4 W4A16 g32 (compressed-tensors)": (files["w4a16"], None, "auto", False),
                   "int4 GGUF Q4_0 file": (files["Q4_0"], None, "auto", False),
                   "int4 GGUF Q4_0 file, W4A8 (--activation-dtype int8)": (files["Q4_0"], None, "int8", False),
                   "int4 GGUF Q4_0 file, W4A8, module by module (--enforce-eager)": (files["Q4_0"], None, "int8", True),
                   "int4 GGUF Q4_K_M file, W4A8 (--activation-dtype int8)": (files["Q4_K_M"], None, "int8", False),
                   "int8 GGUF Q8_0 file": (files["Q8_0"], None, "auto", False)}
        llms = {name: LLM(str(p), max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=4, quantization=q,
                          activation_dtype=a, enforce_eager=e) for name, (p, q, a, e) in configs.items()}
        held = {name: llm.engine.executor.driver_runner.weight_bytes_held() for name, llm in llms.items()}
        stoker: dict[tuple[str, int], list[float]] = {}
        stoker_cpu: dict[tuple[str, int], list[float]] = {}  # process CPU seconds of each step
        llama: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for t in threads:
                torch.set_num_threads(t)
                for name, llm in llms.items():
                    cpu = stoker_cpu.setdefault((name, t), [])
                    stoker.setdefault((name, t), []).append(1 / decode_steps(llm, 1, input_len=64, steps=32, cpu_times=cpu))
                for g in GGUF_TYPES:
                    for test in LLAMA_TESTS:
                        name = g if test == "d64 n32" else f"{g}, {test}"
                        llama.setdefault((name, t), []).append(llama_bench(args.llama_cpp, files[g], t, test))
                done = {n: round(v[(n, t)][-1], 1) for v in (stoker, llama) for n, tt in v if tt == t}
                print(f"# repeat {len(llama[(GGUF_TYPES[0], t)])}, {t} thread(s): {done}", flush=True)
        del llms
        gc.collect()
        sizes = {g: files[g].stat().st_size for g in GGUF_TYPES}
        sizes.update({f"{g}, {test}": sizes[g] for g in GGUF_TYPES for test in LLAMA_TESTS})
    rows = [{"engine": "Stoker", "weights": n, "threads": t, "tokens_per_s": statistics.median(v), "runs": [round(x, 1) for x in v],
             "weight_MB": held[n] / 1e6, "cpu_ms_per_step": 1e3 * statistics.median(stoker_cpu[(n, t)])}
            for (n, t), v in stoker.items()]
    rows += [{"engine": "llama.cpp", "weights": g, "threads": t, "tokens_per_s": statistics.median(v), "runs": [round(x, 1) for x in v],
              "weight_MB": sizes[g] / 1e6} for (g, t), v in llama.items()]
    out = {"machine": f"{cpu_model()}, Stoker ISA build {cpu_linear.target()}", "torch": torch.__version__,
           "repeats": args.repeats, "model": INT4_DECODE_MODEL, "rows": rows}
    print(f"# {out['machine']}; medians of {args.repeats} interleaved repeats")
    for t in threads:
        base = next(r["tokens_per_s"] for r in rows if r["weights"] == "float32" and r["threads"] == t)
        q4_0 = next(r["tokens_per_s"] for r in rows if r["weights"] == "Q4_0" and r["threads"] == t)
        print(f"\n## {t} thread(s)\n\n| engine | weights | MB held / file | tokens/s | vs Stoker float32 | vs llama.cpp Q4_0 (d64 n32) "
              "| CPU ms a step | runs |\n|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r["threads"] == t):
            cpu = f"{r['cpu_ms_per_step']:.1f}" if "cpu_ms_per_step" in r else ""
            print(f"| {r['engine']} | {r['weights']} | {r['weight_MB']:.0f} | {r['tokens_per_s']:.1f} | "
                  f"{r['tokens_per_s'] / base:.2f}x | {r['tokens_per_s'] / q4_0:.2f}x | {cpu} | {r['runs']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
