"""The BERT encoder on one CPU thread: each layer as one C call (kernels/cpu/encoder_layer.c)
against the same model through its modules (pooling/bert.py, the twin), and the attention
alone (issue 18: an embedding server's instance runs one torch thread).

The model and inputs are benchmarks/embeddings_cpu.py's (a MiniLM-shaped random BERT embedder;
queries of 3-10 words, passages of 8-40, tokenized up front). For each workload and batch size
`--batches`, the two paths alternate within each of `--rounds` rounds over the same batches;
medians of microseconds per input (a whole `PoolingRunner.run_rows`: embeddings, layers,
pooling) and of the encoder attention's microseconds per layer call, on the first batches.

    .venv/bin/python benchmarks/bert_layer_cpu.py [--rounds 3] [--batches 9 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as `stoker serve` sets it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.embeddings_cpu import MINILM, WORKLOADS, make_inputs  # noqa: E402
from benchmarks.machine import cpu_model, isa  # noqa: E402


def per_input_us(runner, batches: list) -> float:
    start = time.perf_counter()
    for batch in batches:
        runner.run_rows(batch)
    return 1e6 * (time.perf_counter() - start) / sum(len(b) for b in batches)


def attention_us(runner, batch: list, repeats: int = 200) -> float:
    """One encoder attention call (MiniLM's 12 heads) over the batch's packed tokens."""
    import torch

    from stoker.pooling.attention import VarlenBatch, varlen_batch

    layer = runner.model.encoder.layer[0].attention.get_submodule("self")
    lengths = [len(item.token_ids) for item in batch]
    qkv = torch.randn(sum(lengths), 3, layer.num_heads, layer.head_dim)
    with torch.inference_mode(), varlen_batch(VarlenBatch.build(lengths, torch.device("cpu"))):
        for _ in range(10):
            layer.attn.forward_qkv(qkv)
        start = time.perf_counter()
        for _ in range(repeats):
            layer.attn.forward_qkv(qkv)
    return 1e6 * (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=288)
    ap.add_argument("--batches", type=int, nargs="+", default=[9, 16], help="inputs per batch (the server's mean at c = 32: 8-9)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from stoker.engine.tokenizer import load_tokenizer
    from stoker.pooling.runner import PoolingRunner, PoolInput
    from stoker.testing.tiny_pooling import make_bert_embedder

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_embedder(Path(tmp) / "minilm", **MINILM)
        fused = PoolingRunner.from_folder(str(model_dir), "auto", "cpu", None)
        modules = PoolingRunner.from_folder(str(model_dir), "auto", "cpu", None)
        tokenizer = load_tokenizer(str(model_dir))
    modules.model.encoder.use_fused = False
    rows = []
    for workload, words in WORKLOADS.items():
        ids = tokenizer(make_inputs(args.inputs, words=words))["input_ids"]
        for size in args.batches:
            batches = [[PoolInput(x) for x in ids[i:i + size]] for i in range(0, len(ids) - size + 1, size)]
            for runner in (fused, modules):
                per_input_us(runner, batches[:3])  # warm-up (the fused path is chosen at the first forward)
            times: dict[str, list[float]] = {"fused": [], "modules": []}
            for _ in range(args.rounds):
                times["fused"].append(per_input_us(fused, batches))
                times["modules"].append(per_input_us(modules, batches))
            f, m = statistics.median(times["fused"]), statistics.median(times["modules"])
            attn = attention_us(fused, batches[0])
            tokens = sum(len(x) for x in ids) / len(ids)
            rows.append(f"| {workload} | {size} | {tokens:.1f} | {m:,.0f} | {f:,.0f} | {m / f:.2f}x | {attn:.0f} |")
            print(rows[-1], flush=True)
    print(f"\n{cpu_model()} ({isa()}), 1 torch thread, load average {os.getloadavg()[0]:.2f}; medians of {args.rounds} "
          f"rounds; us per input (run_rows), attention: us per layer call")
    print("| workload | batch | tokens/input | modules | fused layers | speed-up | attention |\n|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
