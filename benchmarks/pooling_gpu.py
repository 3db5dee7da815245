"""Embeddings on a GPU: Stoker's pooling path against sentence-transformers' `encode`, same
model, same inputs, same dtype, same run.

    python benchmarks/pooling_gpu.py                      # BERT-base-shaped, bf16; needs a GPU
    python benchmarks/pooling_gpu.py --workload passages --inputs 2048 --json pooling.json
    python benchmarks/pooling_gpu.py --smoke              # a tiny model on CPU: exercises this
                                                          # script, times nothing useful

Model: a random BERT-base-shaped embedder (hidden 768, 12 layers, 12 heads, intermediate 3072,
512 positions; sentence-transformers layout, mean pooling, normalized) written by
stoker/testing/tiny_pooling.py, no download (its WordPiece vocabulary is small and every word of
it one token; the compute per token is BERT-base's). Both sides load it in `--dtype` (bf16).
Workloads (`--workload`, default both), random and seeded, the same texts for every row:
`passages`, `--inputs` texts of 8-40 words (10-42 tokens with [CLS] and [SEP]), and `fixed128`,
`--inputs` texts of exactly 128 tokens.

Rows, each timed as wall seconds around a whole pass over the texts (every vector back on the
host as numpy; CUDA synchronized before the clock starts), the median of `--repeats` passes after
one warm pass:

  stoker served          `stoker serve`'s /v1/embeddings path without HTTP: the model loaded by
                         server/pooling/models.load_pooling_model with serve's default batcher
                         flags (--max-batch-size 32, no queue delay, one instance on a GPU, the
                         roofline's preferred batch tokens), each text a request of one input
                         tokenized as serving.py does (the inline Rust encode for short texts),
                         all submitted at once to its DynamicBatcher, which runs
                         PoolingRunner.run_rows on the instance thread
  stoker runner bB       the same PoolingRunner called directly on batches of B texts in arrival
                         order (no length sorting): the tokenizer call serving.py makes on the
                         batch's texts, then run_rows (B = `--batch-sizes`; B < 8 on the first
                         eighth of the texts only, to keep the run short; B > 32 is what serve
                         runs with a larger --max-batch-size)
  sentence-transformers bB   SentenceTransformer.encode(texts, batch_size=B) (it sorts by length
                         and pads each batch; tokenization in the timing), B = `--st-batch-sizes`,
                         the best one marked

inputs/s = texts / seconds; tokens/s = their token ids ([CLS] and [SEP] included, no padding) /
seconds. Agreement: per text, the cosine of Stoker's vector (runner, batch 32) and
sentence-transformers' (its best batch size); the minimum and mean are printed beside the mean
cosine of two different texts' vectors (how far below the bar unrelated texts sit), and a
minimum below 0.99 is reported as a failure (exit status 1, after the table). Where sentence-transformers
cannot be imported, the folder is written without it and Stoker runs alone (said, with why, in
the output). Without CUDA (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=512)
SMOKE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                   max_position_embeddings=160)
WORKLOADS = ("passages", "fixed128")
AGREE_MIN_COSINE = 0.99
SMALL_BATCH = 8  # runner rows below this batch size run on the first eighth of the texts
SERVE_MAX_BATCH = 32  # `stoker serve --max-batch-size`'s default (server/pooling/cli.py)


@dataclass
class Row:
    workload: str
    impl: str
    batch: int
    inputs: int
    tokens: int
    seconds: float  # median of the repeats
    inputs_per_s: float
    tokens_per_s: float
    best: bool = False  # sentence-transformers: its best batch size


def make_texts(workload: str, n: int, seed: int = 0) -> list[str]:
    """`passages`: 8-40 words each; `fixed128`: 126 words each (128 tokens with [CLS] and [SEP])."""
    from benchmarks.embeddings_cpu import WORKLOADS as WORDS
    from benchmarks.embeddings_cpu import make_inputs
    from stoker.testing.tiny_pooling import _WORDS

    if workload == "passages":
        return make_inputs(n, seed, WORDS["passages"])
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(126)) for _ in range(n)]


def timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, Any]:
    """Median wall seconds of `repeats` calls after one warm call, and the last call's result."""
    fn()
    times, out = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def load_stoker(model_dir: Path, dtype: str, device: str) -> Any:
    """The PoolingModel `stoker serve MODEL_DIR --dtype DTYPE` holds (default batcher flags)."""
    from stoker.pooling.batcher import BatcherConfig
    from stoker.server.pooling.models import PoolingModelSpec, load_pooling_model

    spec = PoolingModelSpec(str(model_dir), ("m",), BatcherConfig(max_batch_size=SERVE_MAX_BATCH), dtype, device)
    return load_pooling_model(spec)


async def _served_pass(model: Any, texts: list[str]) -> list[np.ndarray]:
    """Every text a one-input request, tokenized and submitted as serving.py does; all awaited."""
    from stoker.pooling.batcher import DynamicBatcher
    from stoker.pooling.runner import PoolInput

    batcher = DynamicBatcher(model.runner.run_rows, model.spec.batcher, model.worker, num_instances=model.num_instances)
    batcher.start()
    try:
        futures = []
        for text in texts:
            ids = model.encode_inline([text], True) or model.tokenizer([text])["input_ids"]
            futures += batcher.submit_many([PoolInput(ids[0])], [len(ids[0])])
        return list(await asyncio.gather(*futures))
    finally:
        await batcher.stop()


def runner_pass(model: Any, texts: list[str], batch: int) -> np.ndarray:
    from stoker.pooling.runner import PoolInput

    out = []
    for i in range(0, len(texts), batch):
        ids = model.tokenizer(texts[i:i + batch], add_special_tokens=True)["input_ids"]
        out += model.runner.run_rows([PoolInput(x) for x in ids])
    return np.stack(out)


def st_available() -> tuple[str | None, str]:
    """sentence-transformers' version, or None and why not. One that fails to import for any
    reason (a dependency missing or mismatched) is then marked absent, so that tiny_pooling
    writes the folder without it and Stoker runs alone rather than the run failing."""
    try:
        import sentence_transformers
    except Exception as exc:  # noqa: BLE001 - any import failure: the comparison is skipped, and said
        sys.modules["sentence_transformers"] = None  # type: ignore[assignment]  # later imports: ImportError
        return None, f"{type(exc).__name__}: {exc}"
    return sentence_transformers.__version__, ""


def load_st(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """sentence-transformers on the same folder, in the same dtype."""
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(model_dir), device=str(device)).to(dtype).eval()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def run_workload(workload: str, texts: list[str], model: Any, st: Any, args: argparse.Namespace,
                 device: torch.device) -> dict[str, Any]:
    tokenize = model.tokenizer
    lengths = [len(x) for x in tokenize(texts, add_special_tokens=True)["input_ids"]]
    rows: list[Row] = []

    def add(impl: str, batch: int, n: int, fn: Callable[[], Any]) -> Any:
        seconds, out = timed(fn, args.repeats, device)
        tokens = sum(lengths[:n])
        rows.append(Row(workload, impl, batch, n, tokens, seconds, n / seconds, tokens / seconds))
        print(f"  {workload:9} {impl:28} {n / seconds:10.1f} inputs/s", flush=True)
        return out

    add("stoker served", SERVE_MAX_BATCH, len(texts), lambda: asyncio.run(_served_pass(model, texts)))
    stoker_vectors = None
    for b in args.batch_sizes:
        n = len(texts) if b >= SMALL_BATCH else max(1, len(texts) // 8)
        out = add(f"stoker runner b{b}", b, n, lambda b=b, n=n: runner_pass(model, texts[:n], b))
        if b == SERVE_MAX_BATCH or stoker_vectors is None and n == len(texts):
            stoker_vectors = out
    result: dict[str, Any] = {"rows": rows, "cosine_min": None, "cosine_mean": None, "other_text_cosine_mean": None,
                              "centered_cosine_min": None}
    if st is None:
        return result
    st_rows = []
    st_vectors: dict[int, np.ndarray] = {}
    for b in args.st_batch_sizes:
        st_vectors[b] = add(f"sentence-transformers b{b}", b, len(texts),
                            lambda b=b: st.encode(texts, batch_size=b, convert_to_numpy=True, show_progress_bar=False))
        st_rows.append(rows[-1])
    best = max(st_rows, key=lambda r: r.inputs_per_s)
    best.best = True
    if stoker_vectors is None:  # every Stoker batch size was a small one: one full pass for the check
        stoker_vectors = runner_pass(model, texts, SERVE_MAX_BATCH)
    reference = np.asarray(st_vectors[best.batch], dtype=np.float32)
    cos = cosines(stoker_vectors, reference)
    # what two different texts score: the check means something only well below the bar
    others = cosines(stoker_vectors, np.roll(stoker_vectors, 1, axis=0))
    # the same on the vectors less their mean over the texts: only what tells texts apart
    center = reference.mean(0, keepdims=True)
    centered = cosines(stoker_vectors - center, reference - center)
    result.update(cosine_min=float(cos.min()), cosine_mean=float(cos.mean()), other_text_cosine_mean=float(others.mean()),
                  centered_cosine_min=float(centered.min()))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--inputs", type=int, default=None, help="texts per workload (default 1024; smoke 16)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="Stoker runner batch sizes (default 1 8 32 64 128; smoke 1 8)")
    parser.add_argument("--st-batch-sizes", type=int, nargs="+", default=None,
                        help="sentence-transformers batch sizes, the best kept (default 32 64 128 256; smoke 8 16)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda (cpu with --smoke); --device cpu without --smoke runs BERT-base on CPU")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU")
    args = parser.parse_args()

    device_name = args.device or ("cpu" if args.smoke else "cuda")
    if device_name == "cuda" and not torch.cuda.is_available():
        print("benchmarks/pooling_gpu.py needs a CUDA GPU (none is visible to torch); nothing was measured. "
              "--smoke runs the script on CPU with a tiny model.")
        return 0
    device = torch.device(device_name)
    args.inputs = args.inputs or (16 if args.smoke else 1024)
    args.batch_sizes = args.batch_sizes or ([1, 8] if args.smoke else [1, 8, 32, 64, 128])
    args.st_batch_sizes = args.st_batch_sizes or ([8, 16] if args.smoke else [32, 64, 128, 256])
    if args.smoke:
        args.repeats = 1
    shape = SMOKE_SHAPE if args.smoke else BERT_BASE
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    logging.getLogger("stoker.server").setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()  # the unused BERT pooler's load report, when the folder is written

    from stoker.testing.tiny_pooling import make_bert_embedder

    t_start = time.perf_counter()
    st_version, st_missing = st_available()
    if st_version is None:
        print(f"sentence-transformers cannot be imported ({st_missing}): Stoker runs alone, no comparison", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="stoker-pooling-gpu-") as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "bert", **shape)
        model = load_stoker(model_dir, args.dtype, device_name)
        st = load_st(model_dir, getattr(torch, args.dtype), device) if st_version else None
        print(f"model built and loaded in {time.perf_counter() - t_start:.1f} s; batcher preferred batch tokens "
              f"{model.spec.batcher.preferred_batch_tokens}", flush=True)
        try:
            for workload in workloads:
                texts = make_texts(workload, args.inputs)
                results[workload] = run_workload(workload, texts, model, st, args, device)
        finally:
            model.worker.shutdown(wait=True)
            model.tokenizer_thread.shutdown(wait=True)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    kind = "a tiny" if args.smoke else "BERT-base-shaped"
    print(f"\n{kind} random embedder (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
          f"{shape['num_attention_heads']} heads, intermediate {shape['intermediate_size']}; mean pooling, "
          f"normalized), {args.dtype} on {where}; {args.inputs} texts per workload; medians of {args.repeats}; "
          f"torch {torch.__version__}; sentence-transformers {st_version or 'not importable: Stoker alone'}")
    print("| workload | impl | batch | inputs | tokens | s | inputs/s | tokens/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for res in results.values():
        for r in res["rows"]:
            mark = " (best)" if r.best else ""
            print(f"| {r.workload} | {r.impl}{mark} | {r.batch} | {r.inputs} | {r.tokens} | {r.seconds:.3f} | "
                  f"{r.inputs_per_s:.1f} | {r.tokens_per_s:.0f} |")
    failed = []
    for workload, res in results.items():
        if res["cosine_min"] is None:
            print(f"{workload}: agreement not checked (no sentence-transformers)")
            continue
        ok = res["cosine_min"] > AGREE_MIN_COSINE
        if not ok:
            failed.append(workload)
        print(f"{workload}: cosine(Stoker, sentence-transformers) min {res['cosine_min']:.5f} mean "
              f"{res['cosine_mean']:.5f} over {args.inputs} texts: {'agree' if ok else 'FAIL'} (> {AGREE_MIN_COSINE}); "
              f"two different texts: mean {res['other_text_cosine_mean']:.3f}; less the mean vector: min "
              f"{res['centered_cosine_min']:.4f}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    if args.smoke:
        print("(smoke: a tiny model on CPU, the times mean nothing)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "dtype": args.dtype, "shape": shape, "inputs": args.inputs,
                       "sentence_transformers": st_version, "repeats": args.repeats,
                       "preferred_batch_tokens": model.spec.batcher.preferred_batch_tokens,
                       "workloads": {w: {**res, "rows": [asdict(r) for r in res["rows"]]} for w, res in results.items()}},
                      f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
