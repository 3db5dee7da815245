"""A tensor-parallel worker: ranks 1..N-1 run this loop; rank 0 (the driver) sends to it.

The loop takes one control message at a time from rank 0 (broadcast on the CPU group):

    ("init", EngineConfig, hf_config, max_model_len)   build this rank's runner and shard
    ("num_blocks", tokens)                             profile; all ranks agree on the minimum
    ("init_cache", num_blocks)                         allocate this rank's KV cache
    ("step", StepMessage)                              one forward (its collectives included); with a
                                                       KV connector, then this rank's finished transfers
                                                       gathered to rank 0
    ("calibrate", None)                                the all-reduce microbenchmark (collective_stats)
    ("ping", None)                                     rank 0 checks that everyone is there
    ("shutdown", None)                                 leave the group and exit 0

The configuration comes from rank 0, so a headless node needs only the rendezvous address
and the checkpoint folder at the same path. Any exception ends the process with status 1
(after logging it): its sockets close, and the other ranks' collectives fail at once rather
than wait for the timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from stoker.executor.launch import Rendezvous

logger = logging.getLogger("stoker.executor.worker")  # also when run as __main__


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: SIGKILL this process when the parent dies (no orphan after `kill -9` of the driver)."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def worker_main(
    rdzv: Rendezvous, device: str, timeout_s: float, parent_pid: int | None = None, model_dir: str | None = None
) -> None:
    """Entry point of a spawned worker process (and of each rank of a headless node)."""
    _die_with_parent(parent_pid)
    from stoker import cpu_runtime

    cpu_runtime.configure_openmp()  # before torch loads
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rdzv.rank} %(name)s: %(message)s")
    try:
        run_worker(rdzv, device, timeout_s, model_dir)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed; exiting", rdzv.rank)
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # torch's atexit hooks may wait on a group that rank 0 has already left


def run_worker(rdzv: Rendezvous, device: str, timeout_s: float, model_dir: str | None = None) -> None:
    import torch.distributed as dist

    from stoker.executor.launch import init_group

    tp = init_group(rdzv, device, timeout_s)
    try:
        serve(tp, model_dir)
    finally:
        dist.destroy_process_group()


def serve(tp: Any, model_dir: str | None = None) -> None:
    """Take rank 0's messages until it says shutdown. `model_dir`: where this node finds the
    checkpoint, when its path differs from rank 0's (a headless node's MODEL_DIR)."""
    import torch

    from stoker.runner.model_runner import ModelRunner

    kind, payload = tp.broadcast_object()
    if kind == "shutdown":
        return
    if kind != "init":
        raise RuntimeError(f"expected the init message first, got {kind!r}")
    config, hf_config, max_model_len = payload
    if model_dir is not None and model_dir != config.model_config.model:
        config = dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, model=model_dir))
    runner = ModelRunner(config, hf_config, max_model_len, tp)
    logger.info("rank %d of %d ready on %s, loaded from %s: %s", tp.rank, tp.world_size, runner.device,
                config.model_config.model, runner.weights_summary())
    while True:
        kind, payload = tp.broadcast_object()
        if kind == "step":
            runner.execute(payload)
            if runner.kv_connector is not None:  # rank 0 merges what each rank's transfers did
                tp.gather_objects(runner.kv_connector.take_finished())
        elif kind == "release":  # sequences finished on rank 0: this rank's drafter state for them
            for seq_id in payload:
                runner.release(seq_id)
        elif kind == "num_blocks":
            tp.min_int(runner.determine_num_blocks(payload))
        elif kind == "init_cache":
            runner.allocate_kv_cache(payload)
            runner.capture_cuda_graphs()
            runner.start_kv_connector()  # with a kv_transfer_config only: this rank's heads, its own agent
        elif kind == "calibrate":
            from stoker.executor.collective_stats import calibrate

            calibrate(tp, runner.device)
        elif kind == "load_lora":
            runner.load_lora(*payload)
        elif kind == "clear_lora":
            runner.clear_lora(payload)
        elif kind == "ping":
            pass
        elif kind == "shutdown":
            runner.close_kv_connector()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            return
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")


def main(argv: list[str] | None = None) -> None:
    """`python -m stoker.executor.worker ...`: how rank 0 and headless nodes start a rank."""
    import argparse

    p = argparse.ArgumentParser(description="one tensor-parallel rank of a Stoker engine (started by Stoker)")
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--model", default=None, help="this node's checkpoint folder (default: rank 0's path)")
    a = p.parse_args(argv)
    rdzv = Rendezvous(a.master_addr, a.master_port, a.world_size, a.rank, a.local_rank)
    worker_main(rdzv, a.device, a.timeout, a.parent_pid, a.model)


if __name__ == "__main__":
    main()
