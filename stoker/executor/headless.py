"""`stoker serve ... --headless`: a node that runs only tensor-parallel ranks (vLLM's flag).

Node k of `--nnodes M` runs ranks [k * tp / M, (k + 1) * tp / M) and no server: it joins
rank 0's rendezvous at --master-addr:--master-port, takes the configuration from rank 0, and
exits when rank 0 shuts the group down (or dies). Every engine setting comes from rank 0, so
a headless node takes only the distributed flags, `--device` and its own MODEL_DIR (the
checkpoint's path on this node); any other flag would be ignored there and is refused. Started by torchrun or Kubernetes with
RANK in the environment, the process runs that one rank itself.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from typing import Any

from stoker.config import ParallelConfig
from stoker.executor import launch

logger = logging.getLogger(__name__)


def run_node(pc: ParallelConfig, device: str, model_dir: str | None = None) -> int:
    """Run this node's ranks until the group ends; the exit status of the worst of them.
    `model_dir`: this node's copy of the checkpoint (default: the path rank 0 loads)."""
    from stoker.executor.worker import worker_main

    env = launch.Rendezvous.from_env()
    if env is not None:
        worker_main(env, device, pc.distributed_timeout_s, model_dir=model_dir)  # exits the process
    if pc.master_port is None:
        raise ValueError("--headless needs --master-port (and --master-addr: node 0's address)")
    if pc.tensor_parallel_size < 2:
        raise ValueError("--headless runs tensor-parallel ranks: pass --tensor-parallel-size > 1")
    ranks = list(pc.node_ranks)
    if 0 in ranks:
        raise ValueError("node 0 runs the engine and its server: start it without --headless")
    rdzv = launch.Rendezvous(pc.master_addr, pc.master_port, pc.tensor_parallel_size, ranks[0], 0)
    procs = launch.spawn_workers(rdzv, ranks, 0, device, pc.distributed_timeout_s, launch.threads_per_rank(len(ranks)),
                                 model_dir)
    logger.info("headless node %d: ranks %s of %d, rendezvous %s:%d", pc.node_rank, ranks, pc.tensor_parallel_size,
                pc.master_addr, pc.master_port)

    def stop(signum: int, frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [_wait(p) for p in procs]
    logger.info("headless node %d: ranks exited with %s", pc.node_rank, codes)
    return max(abs(c) for c in codes)


def _wait(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except InterruptedError:
            continue
