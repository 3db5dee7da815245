"""Where the engine's steps run: one runner in this process, or a tensor-parallel group.

The engine (scheduler, block manager, detokenizer) talks to an executor only through step
messages (`core/step.py`) and a handful of set-up calls, so TP=1 and TP=N share one contract:

    determine_num_blocks(tokens)   KV blocks every rank can hold (the smallest of the ranks)
    initialize_cache(num_blocks)   allocate each rank's KV cache (and capture CUDA graphs)
    execute(step) -> StepResult    one forward on every rank; rank 0 samples
    release(seq_id)                forget a finished sequence's sampling state
    check_health()                 raise WorkerFailedError if a rank is gone
    shutdown()                     stop every worker; no process is left behind

`InProcessExecutor` is TP=1: the runner is called directly, the message is not copied.
`DistributedExecutor` (stoker/distributed/executor.py) is TP>1: this process is rank 0 and
broadcasts each message's forward part to the other ranks over torch.distributed.
"""

from __future__ import annotations

from typing import Any

from stoker.config import EngineConfig
from stoker.core.step import StepMessage
from stoker.runner.model_runner import ModelRunner, StepResult


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank raised, exited or hung past the timeout: the engine cannot step
    any more (every request in flight fails; the server's /health answers 503)."""


class Executor:
    runner: ModelRunner  # this process's runner (rank 0's under tensor parallelism)

    def determine_num_blocks(self, max_num_batched_tokens: int) -> int:
        return self.runner.determine_num_blocks(max_num_batched_tokens)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()  # CUDA and not enforce_eager only

    def execute(self, step: StepMessage) -> StepResult:
        result = self.runner.execute(step)
        assert result is not None, "rank 0 always returns the sampled tokens"
        return result

    def release(self, seq_id: int) -> None:
        self.runner.release(seq_id)

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Copy an adapter into a compute slot (on every rank under tensor parallelism)."""
        self.runner.load_lora(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        self.runner.clear_lora(slot)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def collective_summary(self) -> str | None:
        """A line on the all-reduces since the last call (tensor parallelism only)."""
        return None


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, hf_config: dict[str, Any], max_model_len: int) -> None:
        self.runner = ModelRunner(config, hf_config, max_model_len)


def make_executor(config: EngineConfig, hf_config: dict[str, Any], max_model_len: int) -> Executor:
    """In-process at TP=1; else this process is rank 0 of a group. Started by torchrun (RANK in
    the environment), a process of rank > 0 becomes a worker here and exits when rank 0 is done."""
    if config.parallel_config.tensor_parallel_size == 1:
        return InProcessExecutor(config, hf_config, max_model_len)
    from stoker.distributed.executor import DistributedExecutor
    from stoker.distributed.launch import Rendezvous
    from stoker.distributed.worker import worker_main

    env = Rendezvous.from_env()
    if env is not None and env.rank != 0:
        worker_main(env, config.device, config.parallel_config.distributed_timeout_s)  # does not return

    return DistributedExecutor(config, hf_config, max_model_len)
