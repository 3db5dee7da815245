"""The same GGUF file served by `stoker serve` and by llama.cpp's `llama-server` (issue 34).

    python benchmarks/gguf_serve_vs_llamaserver.py --llama-cpp BUILD --llama-cpp-src SRC \
        [--types Q4_0,Q4_K_M] [--concurrency 1,16] [--repeats 3] [--threads 2] \
        [--input-len 128] [--output-len 64] [--workdir DIR] [--json out.json]

BUILD holds bin/llama-server and bin/llama-quantize, SRC the llama.cpp tree (convert_hf_to_gguf.py):
the GGUF files are int4_vs_llamacpp.py's (the ~0.4B random-weight Llama, converted to f16 and
quantized by llama-quantize), each file sitting alone in its folder so both servers read the
file's own tokenizer and chat template.

Per file, one `stoker serve FILE` and one `llama-server -m FILE` are started on loopback with
the same threads and the same context per sequence (`--max-model-len L --max-num-seqs 16` against
`-c 16*L -np 16 --cont-batching -t T -tb T`); only one of them is under load at a time (the idle
one is blocked on its socket). Each is driven by Stoker's own load generator (stoker/bench: the
code behind `stoker bench serve`), streamed `/v1/completions` with `ignore_eos` and `max_tokens`
so both generate exactly --output-len tokens, random prompts of exactly --input-len tokens (the
checkpoint's tokenizer; a new prompt set per repeat, the same set for both servers, so no prefix
cache helps). A repeat runs every (concurrency, server) pair back to back, servers alternating;
reported per pair: medians over repeats of output tokens/s, TTFT and ITL medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from int4_vs_llamacpp import make_gguf_files  # noqa: E402
from quantized_cpu import INT4_DECODE_MODEL  # noqa: E402

from benchmarks.machine import cpu_model, isa  # noqa: E402
from stoker.bench.cli import register  # noqa: E402
from stoker.bench.runner import LoadConfig  # noqa: E402
from stoker.bench.serve import prepare, run_once  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

SERVERS = ("stoker", "llama.cpp")


def make_checkpoint(work: Path) -> None:
    """int4_vs_llamacpp.py's float32 HF Llama, its LM head rows zeroed except for the tokens that
    decode to whole text on their own.

    The model's vocabulary is 32000 and the demo tokenizer's 1024: the converter pads the GGUF
    vocabulary with unused `[PAD<id>]` tokens, which llama.cpp detokenizes to nothing and the HF
    tokenizer to their names, and a byte-level BPE token holding part of a UTF-8 character is
    held back by both streams until the character completes. Random weights pick those tokens
    often; a zero row has logit 0, below the maximum of ~1000 random logits, so greedy decoding
    never picks them and every token streams as one content chunk on both servers (ITL per
    token). The shapes, the bytes and the work per token are the model's own.
    """
    hf = work / "hf"
    if (hf / "config.json").exists():
        return
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    make_tiny_checkpoint(hf, "llama", **INT4_DECODE_MODEL)
    tok = AutoTokenizer.from_pretrained(hf)
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    keep = [i for i in range(len(tok)) if i not in special and "\ufffd" not in tok.decode([i])]
    state = load_file(hf / "model.safetensors")
    head = state["lm_head.weight"]  # [vocab, hidden]; tie_word_embeddings is false
    rows = torch.zeros(head.shape[0], dtype=torch.bool)
    rows[keep] = True
    state["lm_head.weight"] = torch.where(rows[:, None], head, torch.zeros_like(head)).contiguous()
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    print(f"# LM head: {len(keep)} of {head.shape[0]} rows kept (whole-text tokens)", flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One server process on loopback, started and waited for until /v1/models lists a model."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        self.root = f"http://127.0.0.1:{port}"
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(self.root + "/v1/models", timeout=5) as resp:
                    if resp.status == 200 and json.load(resp).get("data"):
                        return time.perf_counter() - t0
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log}")

    def cpu_seconds(self) -> float:
        """utime + stime of the server process (Linux /proc): the idle server's share of a run."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def start_servers(gguf: Path, args: argparse.Namespace, logs: Path) -> dict[str, Server]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    seqs, ctx = max(args.concurrency), args.max_model_len
    sp, lp = free_port(), free_port()
    stoker = Server("stoker", [sys.executable, "-m", "stoker", "serve", str(gguf), "--host", "127.0.0.1",
                               "--port", str(sp), "--max-model-len", str(ctx), "--max-num-seqs", str(seqs),
                               "--kv-cache-memory-bytes", str(args.kv_cache_mib << 20),
                               "--activation-dtype", args.activation_dtype],
                    sp, env, logs / f"stoker-{gguf.stem}.log")
    llama = Server("llama.cpp", [str(args.llama_cpp / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                                 "--port", str(lp), "-c", str(ctx * seqs), "-np", str(seqs), "--cont-batching",
                                 "-t", str(args.threads), "-tb", str(args.threads), "--no-webui"],
                   lp, env, logs / f"llama-server-{gguf.stem}.log")
    servers = {"stoker": stoker, "llama.cpp": llama}
    for s in servers.values():
        print(f"# {s.name} on {gguf.name} ready in {s.wait_ready():.1f} s", flush=True)
    return servers


def drive(server: Server, args: argparse.Namespace, concurrency: int, seed: int) -> dict:
    """One load run (stoker/bench's `bench serve`) -> its result dict."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    num_prompts = args.prompts_c1 if concurrency == 1 else concurrency * args.waves
    bench_args = parser.parse_args([
        "bench", "serve", "--base-url", server.root, "--endpoint", "completions", "--dataset", "random",
        "--tokenizer", str(args.tokenizer), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--seed", str(seed), "--disable-tqdm"])
    prep = prepare(bench_args)
    result = run_once(prep, LoadConfig.from_args(bench_args), label=f"{server.name} c{concurrency}", show_progress=False)
    if result["failed"]:
        raise RuntimeError(f"{server.name} c{concurrency}: {result['failed']} failed: "
                           f"{[e for e in result['errors'] if e][:3]}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp build dir (bin/llama-server, bin/llama-quantize)")
    ap.add_argument("--llama-cpp-src", required=True, type=Path, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help="llama-quantize types to serve")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=256, help="context per sequence, both servers")
    ap.add_argument("--kv-cache-mib", type=int, default=512, help="Stoker's KV-cache budget")
    ap.add_argument("--activation-dtype", default="auto", choices=["auto", "int8"],
                    help="Stoker's --activation-dtype (int8: W4A8, llama.cpp's Q4_0 x Q8_0 method)")
    ap.add_argument("--prompts-c1", type=int, default=3, help="requests per concurrency-1 run")
    ap.add_argument("--waves", type=int, default=1, help="requests per concurrency-c run: c x waves")
    ap.add_argument("--workdir", type=Path, help="keep the checkpoints here (default: a temporary folder)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    types = args.types.split(",")
    load_before = os.getloadavg()
    runs: dict[tuple[str, str, int], list[dict]] = {}
    idle_cpu: dict[str, float] = {s: 0.0 for s in SERVERS}
    with tempfile.TemporaryDirectory() as d:
        work = args.workdir or Path(d)
        work.mkdir(parents=True, exist_ok=True)
        make_checkpoint(work)
        files = make_gguf_files(work, args.llama_cpp, args.llama_cpp_src, types)
        args.tokenizer = files["hf"]
        for t in types:
            # Each file alone in a folder: Stoker takes a sibling HF tokenizer when there is one.
            alone = work / f"serve-{t}" / f"{t}.gguf"
            alone.parent.mkdir(exist_ok=True)
            if not alone.exists():
                os.link(files[t], alone)
            servers = start_servers(alone, args, work)
            try:
                for rep in range(args.repeats):
                    for c in args.concurrency:
                        order = SERVERS if rep % 2 == 0 else SERVERS[::-1]
                        for name in order:
                            other = next(s for s in SERVERS if s != name)
                            cpu0 = servers[other].cpu_seconds()
                            r = drive(servers[name], args, c, seed=rep)
                            idle_cpu[other] += servers[other].cpu_seconds() - cpu0
                            runs.setdefault((t, name, c), []).append(r)
                            print(f"# {t} repeat {rep + 1} c={c} {name}: {r['output_throughput']:.1f} tok/s, "
                                  f"TTFT {r['median_ttft_ms']:.0f} ms, ITL {r['median_itl_ms']:.1f} ms, "
                                  f"out {sum(r['output_lens'])} in {sum(r['input_lens'])}", flush=True)
            finally:
                for s in servers.values():
                    s.stop()
    load_after = os.getloadavg()
    rows = []
    for (t, name, c), rs in runs.items():
        rows.append({"file": t, "server": name, "concurrency": c,
                     "output_tokens_per_s": statistics.median(r["output_throughput"] for r in rs),
                     "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in rs),
                     "median_itl_ms": statistics.median(r["median_itl_ms"] for r in rs),
                     "runs_tokens_per_s": [round(r["output_throughput"], 1) for r in rs],
                     "output_tokens_per_request": sorted({n for r in rs for n in r["output_lens"]}),
                     "prompt_tokens_per_request": sorted({n for r in rs for n in r["input_lens"]})})
    out = {"machine": f"{cpu_model()}, {isa()}", "load_average_before": load_before, "load_average_after": load_after,
           "threads": args.threads, "activation_dtype": args.activation_dtype, "input_len": args.input_len, "output_len": args.output_len,
           "repeats": args.repeats, "idle_server_cpu_s": idle_cpu, "rows": rows}
    print(f"\n# {out['machine']}; {args.threads} threads; load average before {load_before}, after {load_after}; "
          f"idle server CPU s over the other's runs {idle_cpu}")
    print("\n| file | concurrency | server | output tokens/s | vs llama-server | median TTFT ms | median ITL ms | "
          "runs (tokens/s) |\n|---|---:|---|---:|---:|---:|---:|---|")
    for row in rows:
        peer = next(r for r in rows if r["file"] == row["file"] and r["concurrency"] == row["concurrency"]
                    and r["server"] == "llama.cpp")
        print(f"| {row['file']} | {row['concurrency']} | {row['server']} | {row['output_tokens_per_s']:.1f} | "
              f"{row['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}x | {row['median_ttft_ms']:.0f} | "
              f"{row['median_itl_ms']:.1f} | {row['runs_tokens_per_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
