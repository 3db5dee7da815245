"""What structured decoding costs: issue 2's workload with every request under a JSON schema, vs
none, in the same process, interleaved per repeat; and the time to compile a schema.

    python benchmarks/structured_cpu.py --repeats 3

Workload (issue 2's): 64 requests, prompt lengths uniform in [32, 256], output lengths uniform in
[16, 128], greedy, on a Llama-shaped random float32 model (hidden 512, 8 layers, vocab 1024).
Free requests run with ignore_eos; constrained ones follow a schema that needs at least 64
array items, so they too run to their max_tokens: both runs generate the same token counts, and
the difference is the grammar's (mask fill per row, bitmask application, accepting the token).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model, isa  # noqa: E402
from benchmarks.tp_cpu import ISSUE2_SHAPE  # noqa: E402
from stoker import LLM, SamplingParams  # noqa: E402
from stoker.structured.spec import StructuredOutputs  # noqa: E402
from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "minItems": 64,
                                                       "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]}}},
          "required": ["values"], "additionalProperties": False}
# What compile time is quoted for: a nested schema like an agent's tool arguments.
NESTED = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"]},
    "tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["a", "b", "c"]}},
    "required": ["name", "age", "address"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    args = ap.parse_args()
    tmp_dir = tempfile.TemporaryDirectory()  # removed at exit, also when a run fails
    path = make_tiny_checkpoint(Path(tmp_dir.name) / "m512", "llama", **ISSUE2_SHAPE)
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 29, max_model_len=1024, device="cpu")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(rng.randint(32, 256))]} for _ in range(args.num_prompts)]
    lens = [rng.randint(16, 128) for _ in prompts]
    spec = StructuredOutputs.from_schema(SCHEMA)
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
    constrained = [SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=spec) for n in lens]
    llm.generate(prompts[:4], free[:4], use_tqdm=False)  # warm-up both paths
    llm.generate(prompts[:4], constrained[:4], use_tqdm=False)
    times: dict[str, list[float]] = {"none": [], "json_schema": []}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, params in (("none", free), ("json_schema", constrained)):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outs)
    compile_ms = []
    grammars = llm.engine.grammars
    for i in range(5):  # a fresh schema each time (the cache would answer a repeat)
        nested = {**NESTED, "title": f"s{i}"}
        start = time.perf_counter()
        grammars.compile(StructuredOutputs.from_schema(nested))
        compile_ms.append((time.perf_counter() - start) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# structured decoding: {cpu_model()} ({isa()}), {platform.machine()}, {args.num_prompts} requests, "
          f"medians of {args.repeats} interleaved repeats")
    print("| constraint | output tokens | seconds | tokens/s |")
    print("|---|---|---|---|")
    for k in times:
        print(f"| {k} | {tokens[k]} | {med[k]:.2f} | {tokens[k] / med[k]:.0f} |")
    print(f"json_schema / none time: {med['json_schema'] / med['none']:.3f}; "
          f"per repeat: {[round(c / f, 3) for c, f in zip(times['json_schema'], times['none'])]}")
    print(f"compile a nested schema: median {statistics.median(compile_ms):.2f} ms (5 fresh schemas: "
          f"{', '.join(f'{t:.2f}' for t in compile_ms)})")
    print(json.dumps({"times": times, "tokens": tokens, "compile_ms": compile_ms}))
    llm.shutdown()


if __name__ == "__main__":
    main()
