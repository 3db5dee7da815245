"""KV transfer over NIXL on loopback (CPU, host memory, UCX): the raw READ rate between two
processes, and the per-request transfer of a disaggregated prefill/decode pair against
computing the same prompt locally.

    UCX_NET_DEVICES=lo python benchmarks/kv_transfer_cpu.py --repeats 7

Part 1 (two processes): a holder process registers a 64 MiB host buffer with its NIXL agent;
this process READs the first `size` bytes of it into its own registered buffer, one read at a
time, timed from post to DONE (what the decode engine's worker side does per request). Peer in
the same run: torch's copy of the same bytes inside one process (memcpy bandwidth, the ceiling
of any loopback transport).

Part 2 (two engines in this process, each with its own NIXL agent and side channel): a prefill
engine computes a prompt and leases its blocks; a decode engine READs them (the connector's
path end to end: handshake once, then the read and its notification) and computes the last
token. Reported: the read's time (vllm:nixl_xfer_time_seconds, one per request), the bytes
read, and the peer: the time the same prompt's prefill takes on an engine without a connector.
Model: the Llama-shaped random float32 checkpoint the CPU benchmarks share (hidden 512,
8 layers, 4 KV heads of 64: 16 KiB of K/V per token).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from benchmarks.machine import cpu_model, isa  # noqa: E402
from benchmarks.tp_cpu import ISSUE2_SHAPE  # noqa: E402

HOLDER_BYTES = 64 << 20
SIZES = (16 << 10, 256 << 10, 4 << 20, 64 << 20)


def holder(conn: mp.connection.Connection) -> None:
    """Register a buffer, hand its agent metadata and address over, serve reads until told to stop."""
    import torch

    from stoker.kv_transfer.transport import NixlTransport

    buf = torch.arange(HOLDER_BYTES // 4, dtype=torch.int32)
    t = NixlTransport("bench-holder")
    t.register([(buf.data_ptr(), HOLDER_BYTES)], "DRAM")
    conn.send((t.metadata(), buf.data_ptr()))
    conn.recv()  # stop
    t.close()


def read_rate(repeats: int) -> list[dict]:
    import torch

    from stoker.kv_transfer.transport import NixlTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=holder, args=(child,), daemon=True)
    proc.start()
    metadata, remote_addr = parent.recv()
    local = torch.zeros(HOLDER_BYTES // 4, dtype=torch.int32)
    t = NixlTransport("bench-reader")
    t.register([(local.data_ptr(), HOLDER_BYTES)], "DRAM")
    peer = t.add_peer(metadata)
    src = torch.arange(HOLDER_BYTES // 4, dtype=torch.int32)  # the memcpy peer's source, touched once
    rows = []
    for size in SIZES:
        times, copies = [], []
        for i in range(repeats + 1):
            start = time.perf_counter()
            h = t.read(peer, [(local.data_ptr(), size)], [(remote_addr, size)], "DRAM", b"")
            while (state := t.state(h)) == "PROC":
                pass
            elapsed = time.perf_counter() - start
            t.release(h)
            assert state == "DONE", state
            if i == 0:  # the bytes arrived (the holder's buffer counts up from 0)
                assert torch.equal(local[: size // 4], torch.arange(size // 4, dtype=torch.int32))
            start = time.perf_counter()
            local[: size // 4].copy_(src[: size // 4])
            copy = time.perf_counter() - start
            if i:  # the first read of a size warms UCX's registration caches
                times.append(elapsed)
                copies.append(copy)
        med, cp = statistics.median(times), statistics.median(copies)
        rows.append({"size": size, "read_us": med * 1e6, "read_gbps": size / med / 1e9, "copy_gbps": size / cp / 1e9})
    parent.send("stop")
    proc.join(10)
    t.close()
    return rows


def per_request(repeats: int, lengths: list[int]) -> list[dict]:
    from stoker import LLM, SamplingParams
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint
    from tests.server.conftest import free_port

    tmp = tempfile.TemporaryDirectory(prefix="kv-transfer-bench-")  # removed when the engines are done
    path = make_tiny_checkpoint(Path(tmp.name) / "m512", "llama", **ISSUE2_SHAPE)
    kw = {"kv_cache_memory_bytes": 1 << 28, "max_model_len": 2048, "seed": 0}

    def kv() -> dict:
        return {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"side_channel_port": free_port()}}

    prefill = LLM(str(path), kv_transfer_config=kv(), **kw)
    decode = LLM(str(path), kv_transfer_config=kv(), **kw)
    local = LLM(str(path), **kw)

    def run(llm: LLM, rid: str, ids: list[int], params: SamplingParams) -> tuple[float, object]:
        e = llm.engine
        start = time.perf_counter()
        e.add_request(e.input_processor.process(rid, prompt_token_ids=ids, params=params))
        out = None
        while e.has_unfinished_requests():
            for o in e.step():
                out = o if o.finished else out
        return time.perf_counter() - start, out

    rows = []
    n = 0
    for length in lengths:
        xfer, nbytes, recompute = [], [], []
        for _ in range(repeats):
            n += 1
            ids = [(7 * n + 13 * i) % 1000 + 5 for i in range(length)]  # a fresh prompt: no prefix hit anywhere
            _, p = run(prefill, f"p{n}", ids, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
            before = decode.engine.stats().kv_transfer
            t0, c0 = before.xfer_time_seconds.total, before.bytes_transferred.total
            _, d = run(decode, f"d{n}", ids, SamplingParams(temperature=0, max_tokens=1, kv_transfer_params=p.kv_transfer_params))
            after = decode.engine.stats().kv_transfer
            xfer.append(after.xfer_time_seconds.total - t0)
            nbytes.append(after.bytes_transferred.total - c0)
            secs, ref = run(local, f"l{n}", ids, SamplingParams(temperature=0, max_tokens=1))
            recompute.append(secs)
            assert d.outputs[0].token_ids == ref.outputs[0].token_ids
            while prefill.engine.has_pending_kv_transfers():
                prefill.engine.step()
        rows.append({"tokens": length, "bytes": statistics.median(nbytes), "xfer_ms": statistics.median(xfer) * 1e3,
                     "prefill_ms": statistics.median(recompute) * 1e3})
    for llm in (prefill, decode, local):
        llm.shutdown()
    tmp.cleanup()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    args = ap.parse_args()
    print(f"machine: {cpu_model()} ({isa()}), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"Python {platform.python_version()}")
    print("\nNIXL READ between two processes on loopback (UCX, host memory), median of", args.repeats)
    print(f"{'bytes':>10} {'read us':>10} {'read GB/s':>10} {'memcpy GB/s':>12} {'read/memcpy':>12}")
    for r in read_rate(args.repeats):
        print(f"{r['size']:>10} {r['read_us']:>10.1f} {r['read_gbps']:>10.2f} {r['copy_gbps']:>12.2f} "
              f"{r['read_gbps'] / r['copy_gbps']:>12.2f}")
    print("\nPer request: the decode engine's read of the prompt's K/V vs computing the prompt locally, median of",
          args.repeats)
    print(f"{'tokens':>7} {'KV bytes':>10} {'read ms':>9} {'prefill ms':>11} {'read/prefill':>13} {'read GB/s':>10}")
    for r in per_request(args.repeats, args.lengths):
        print(f"{r['tokens']:>7} {int(r['bytes']):>10} {r['xfer_ms']:>9.2f} {r['prefill_ms']:>11.1f} "
              f"{r['xfer_ms'] / r['prefill_ms']:>13.3f} {r['bytes'] / r['xfer_ms'] / 1e6:>10.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
