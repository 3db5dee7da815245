"""KV transfer over NIXL on loopback (CPU, host memory, UCX): the raw READ rate between two
processes, and the per-request transfer of a disaggregated prefill/decode pair against
computing the same prompt locally.

    UCX_NET_DEVICES=lo python benchmarks/kv_transfer_cpu.py --repeats 7

Part 1 (two processes): a holder process registers a 64 MiB host buffer with its NIXL agent;
this process READs the first `size` bytes of it into its own registered buffer, one read at a
time, timed from post to DONE (what the decode engine's worker side does per request); median
and best. Peer in the same run: torch's copy of the same bytes inside one process, the best of
three per repeat, best over the repeats, one thread (memcpy bandwidth, the ceiling of any loopback
transport).

Part 2 (two engines in this process, each with its own NIXL agent and side channel): a prefill
engine computes a prompt and leases its blocks; a decode engine READs them (the connector's
path end to end: handshake once, then the read and its notification) and computes the last
token. Reported: the read's time (vllm:nixl_xfer_time_seconds, one per request), the bytes
read, and the peer: the time the same prompt's prefill takes on an engine without a connector.
Model: the Llama-shaped random float32 checkpoint the CPU benchmarks share (hidden 512,
8 layers, 4 KV heads of 64: 16 KiB of K/V per token).

Part 3 (the serve loop, AsyncEngine): a prefill engine holds a lease no reader takes (what a
prefill server holds between the prefill leg and the decode side's read), and a short request
arrives at a random moment (the smallest test model: the wait, not the compute, is measured); its
time to first token, with the loop's waits between transfer
polls as they were (a 10 ms sleep while only leases are held) and as they are (a wait that a
new request ends at once), alternated per request in the same run.

The first two parts print the roofline's prediction beside the measurement (stoker/roofline/disagg.py
`kv_transfer`: bytes / (link GB/s x the comm efficiency), no latency term), with two rates for
the link: the table's "loopback" entry (a memory copy measured once on the project's VM) and
this run's memcpy of the largest size (the same ceiling, measured now, under this run's load).
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
    # One thread copies, as one UCX progress thread moves a read: torch splits larger copies over its
    # threads, and on a loaded machine the split waits for a descheduled thread (0.01 GB/s at 256 KiB).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
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
            copy = float("inf")
            for _ in range(3):  # the copy's best of three: a ceiling, which one preemption must not hide
                start = time.perf_counter()
                local[: size // 4].copy_(src[: size // 4])
                copy = min(copy, time.perf_counter() - start)
            if i:  # the first read of a size warms UCX's registration caches
                times.append(elapsed)
                copies.append(copy)
        med, cp = statistics.median(times), min(copies)
        rows.append({"size": size, "read_us": med * 1e6, "read_gbps": size / med / 1e9, "best_read_us": min(times) * 1e6,
                     "copy_gbps": size / cp / 1e9})
    torch.set_num_threads(threads)
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
                     "prefill_ms": statistics.median(recompute) * 1e3,
                     "roofline_bytes": prompt_bytes(path / "config.json", length)})
    for llm in (prefill, decode, local):
        llm.shutdown()
    tmp.cleanup()
    return rows


def predicted_ms(num_bytes: float, gb_per_s: float) -> float:
    """The roofline's transfer time: bytes over the link's rate at the engine's comm efficiency
    (what `kv_transfer` computes per stream)."""
    from stoker.roofline.profiles import ENGINE

    return num_bytes / (gb_per_s * 1e9 * ENGINE.comm) * 1e3


def prompt_bytes(config_path: Path, tokens: int) -> float:
    """The roofline's K/V bytes of a prompt of the benchmark's model (float32 cache)."""
    import json

    from stoker.roofline.disagg import kv_transfer
    from stoker.roofline.gpu_spec import get_link
    from stoker.roofline.modelspec import spec_from_config

    spec = spec_from_config(json.loads(config_path.read_text()), "bench-m512")
    return kv_transfer(spec, tokens, "fp32", get_link("loopback")).bytes_per_prompt


def poll_wake(repeats: int) -> dict[str, list[float]]:
    """Part 3: TTFT (ms) of a short request to an engine holding a lease, per way of waiting."""
    import asyncio
    import random

    from stoker import LLM, SamplingParams
    from stoker.engine.async_engine import AsyncEngine
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint
    from tests.server.conftest import free_port

    import torch

    # One thread: on a shared 2-vCPU machine an OpenMP barrier waiting for a descheduled thread costs more
    # than this model's whole step (measured: ~1.5 s TTFT at 2 threads, load 18; ~10 ms at 1 thread).
    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="kv-transfer-bench-")
    # the smallest test model (2 layers of hidden 64): the step is short, so the wait before it shows
    path = make_tiny_checkpoint(Path(tmp.name) / "tiny", "llama")
    kv = {"kv_connector": "NixlConnector",
          "kv_connector_extra_config": {"side_channel_port": free_port(), "kv_lease_duration": 3600}}

    async def run() -> dict[str, list[float]]:
        engine = await AsyncEngine.build(lambda: LLM(str(path), kv_transfer_config=kv, kv_cache_memory_bytes=1 << 26,
                                                     max_model_len=512, seed=0).engine)
        llm_engine = engine._engine
        wake = llm_engine.transfer_poll_wait  # the serve loop's (set by AsyncEngine)
        engine.start()

        async def ttft(rid: str, ids: list[int], params: SamplingParams) -> float:
            start = time.perf_counter()
            async for _ in engine.add_request(llm_engine.input_processor.process(rid, None, params, ids)):
                return (time.perf_counter() - start) * 1e3
            raise AssertionError("no output")

        # the lease: a prefill leg whose decode side never reads
        await ttft("lease", list(range(5, 69)), SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        assert llm_engine.has_pending_kv_transfers()
        times: dict[str, list[float]] = {"10 ms sleep (before)": [], "wait on wake-up (now)": []}
        rng = random.Random(0)
        for i in range(repeats):
            for name, wait in (("10 ms sleep (before)", time.sleep), ("wait on wake-up (now)", wake))[:: 1 - 2 * (i % 2)]:
                llm_engine.transfer_poll_wait = wait
                await asyncio.sleep(rng.uniform(0.02, 0.04))  # arrive at a random point of the poll cycle
                ids = [(7 * i + 3 * j) % 900 + 50 for j in range(8)]
                times[name].append(await ttft(f"{name[:2]}{i}", ids, SamplingParams(max_tokens=1, temperature=0)))
        assert llm_engine.has_pending_kv_transfers()  # the lease held throughout
        await engine.shutdown(drain_timeout_s=0)
        return times

    try:
        return asyncio.run(run())
    finally:
        tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--wake-repeats", type=int, default=40, help="requests per way of waiting in part 3")
    ap.add_argument("--parts", default="123", help="which parts to run (1: raw reads, 2: per request, 3: serve loop)")
    args = ap.parse_args()
    print(f"machine: {cpu_model()} ({isa()}), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"Python {platform.python_version()}")
    from stoker.roofline.gpu_spec import get_link

    table = get_link("loopback").gb_per_s
    measured = None  # this run's memcpy rate (part 1)
    if "1" in args.parts:
        print("\nNIXL READ between two processes on loopback (UCX, host memory), median of", args.repeats)
        print(f"roofline link: 'loopback' {table:g} GB/s (table) and this run's memcpy of {SIZES[-1] >> 20} MiB")
        print(f"{'bytes':>10} {'read us':>10} {'best read us':>13} {'read GB/s':>10} {'memcpy GB/s':>12} "
              f"{'read/memcpy':>12} {'roofline us (table)':>20} {'(this memcpy)':>14}")
        rates = read_rate(args.repeats)
        measured = rates[-1]["copy_gbps"]
        for r in rates:
            print(f"{r['size']:>10} {r['read_us']:>10.1f} {r['best_read_us']:>13.1f} {r['read_gbps']:>10.2f} "
                  f"{r['copy_gbps']:>12.2f} {r['read_gbps'] / r['copy_gbps']:>12.2f} "
                  f"{predicted_ms(r['size'], table) * 1e3:>20.1f} {predicted_ms(r['size'], measured) * 1e3:>14.1f}")
    if "2" in args.parts:
        print("\nPer request: the decode engine's read of the prompt's K/V vs computing the prompt locally, median of",
              args.repeats, "; roofline: the same prompt's K/V over the 'loopback' link")
        print(f"{'tokens':>7} {'KV bytes':>10} {'read ms':>9} {'prefill ms':>11} {'read/prefill':>13} {'read GB/s':>10} "
              f"{'roofline ms (table)':>20} {'(this memcpy)':>14} {'measured/table':>15}")
        for r in per_request(args.repeats, args.lengths):
            # the roofline's bytes are the prompt's tokens'; the read moves whole blocks (equal at multiples of 16)
            table_ms = predicted_ms(r["roofline_bytes"], table)
            this = f"{predicted_ms(r['roofline_bytes'], measured):>14.2f}" if measured else f"{'-':>14}"
            print(f"{r['tokens']:>7} {int(r['bytes']):>10} {r['xfer_ms']:>9.2f} {r['prefill_ms']:>11.1f} "
                  f"{r['xfer_ms'] / r['prefill_ms']:>13.3f} {r['bytes'] / r['xfer_ms'] / 1e6:>10.2f} {table_ms:>20.2f} "
                  f"{this} {r['xfer_ms'] / table_ms:>15.1f}")
    if "3" in args.parts:
        print("\nThe serve loop: TTFT of an 8-token prompt (max_tokens 1) to an engine holding a lease, "
              f"{args.wake_repeats} requests per way of waiting, alternated")
        for name, ms in poll_wake(args.wake_repeats).items():
            ms = sorted(ms)
            print(f"{name:>24}: median {statistics.median(ms):6.2f} ms, p90 {ms[int(0.9 * (len(ms) - 1))]:6.2f} ms")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
