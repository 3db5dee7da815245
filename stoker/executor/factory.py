"""Which executor an engine gets: in-process at TP=1, else this process is rank 0 of a group."""

from __future__ import annotations

from typing import Any

from stoker.config import EngineConfig
from stoker.executor.contract import Executor


def make_executor(config: EngineConfig, hf_config: dict[str, Any], max_model_len: int) -> Executor:
    """Started by torchrun (RANK in the environment), a process of rank > 0 becomes a worker
    here and exits when rank 0 is done."""
    if config.parallel_config.tensor_parallel_size == 1:
        from stoker.executor.in_process import InProcessExecutor

        return InProcessExecutor(config, hf_config, max_model_len)
    from stoker.executor.distributed import DistributedExecutor
    from stoker.executor.launch import Rendezvous
    from stoker.executor.worker import worker_main

    env = Rendezvous.from_env()
    if env is not None and env.rank != 0:
        worker_main(env, config.device, config.parallel_config.distributed_timeout_s)  # does not return
    return DistributedExecutor(config, hf_config, max_model_len)
