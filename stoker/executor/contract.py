"""The executor contract: everything the engine asks of the runner(s) that run its steps.

The engine (scheduler, block manager, input and output processors) talks to its runners only
through these calls, so TP=1 and TP=N, and later a remote runner, share one contract (DESIGN.md,
seam 23); it never reaches into a runner:

    describe() -> RunnerInfo             rank 0's device, dtypes, KV-cache spec, weights held
    determine_num_blocks(tokens)         KV blocks every rank can hold (the smallest of the ranks)
    initialize_cache(num_blocks)         allocate each rank's KV cache (and capture CUDA graphs)
    execute(step) -> StepResult          one forward on every rank; rank 0 samples
    release(seq_id)                      forget a finished sequence's sampling state
    load_lora(slot, adapter) / clear_lora(slot)   an adapter into / out of a compute slot
    enable_structured_outputs(grammars)  the grammar cache the sampling rank masks logits with
    check_health()                       raise WorkerFailedError if a rank is gone
    collective_summary()                 a line on the all-reduces since the last call (TP only)
    expert_load() -> ExpertLoad | None   tokens per expert per MoE layer since start (rank 0's
                                         counts: the router is replicated); None for a dense model
    shutdown()                           stop every worker; no process is left behind

`InProcessExecutor` (executor/in_process.py) is TP=1; `DistributedExecutor`
(executor/distributed.py) is TP>1: this process is rank 0 and broadcasts each message's forward
part to the other ranks over torch.distributed. `make_executor` (executor/factory.py) picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from stoker.core.expert_load import ExpertLoad
from stoker.core.step import StepMessage, StepResult
from stoker.runner.info import RunnerInfo


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank raised, exited or hung past the timeout: the engine cannot step
    any more (every request in flight fails; the server's /health answers 503)."""


class Executor(ABC):
    @abstractmethod
    def describe(self) -> RunnerInfo: ...

    @abstractmethod
    def determine_num_blocks(self, max_num_batched_tokens: int) -> int: ...

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute(self, step: StepMessage) -> StepResult: ...

    @abstractmethod
    def release(self, seq_id: int) -> None: ...

    @abstractmethod
    def load_lora(self, slot: int, adapter: Any) -> None:
        """Copy an adapter into a compute slot (on every rank under tensor parallelism)."""

    @abstractmethod
    def clear_lora(self, slot: int) -> None: ...

    @abstractmethod
    def enable_structured_outputs(self, grammars: Any) -> None:
        """Give the sampling rank the compiled-grammar cache (structured/grammar.py)."""

    def check_health(self) -> None:
        pass

    def collective_summary(self) -> str | None:
        return None

    def expert_load(self) -> ExpertLoad | None:
        return None

    def shutdown(self) -> None:
        pass
