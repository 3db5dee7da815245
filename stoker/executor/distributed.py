"""The tensor-parallel executor: this process is rank 0, the driver; ranks 1..N-1 are workers.

Rank 0 holds the scheduler and its own shard. Each step it broadcasts the message's forward
part (`StepMessage.for_workers()`: ids, positions, block tables, which rows sample; no
sampling parameters) on the CPU group, runs its forward in lockstep with the workers (the
all-reduces and the logits gather are the collectives of the device group), and samples
alone. Only the sampled ids leave the forward, and they never leave this process.

Failure: a worker that raises exits (worker.py), and gloo/NCCL calls on its peers fail at
once ("connection closed"); a worker that hangs makes rank 0's next collective time out
(`distributed_timeout_s`); a spawned worker's exit is also seen by a watchdog thread while
idle, and `check_health` (called by the server's idle loop) pings every rank. Any of these
marks the executor dead: `execute` raises WorkerFailedError from then on. A failure inside
rank 0's forward is fatal too (the workers would be left inside a collective); one in
sampling is not (no collective there: only that step's requests fail).
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import threading
import time
from typing import Any

import torch

from stoker.config import EngineConfig
from stoker.core.expert_load import ExpertLoad
from stoker.core.step import StepMessage, StepResult
from stoker.executor import launch
from stoker.executor.collective_stats import CollectiveMonitor, calibrate
from stoker.executor.contract import Executor, RunnerInfo, WorkerFailedError
from stoker.kv_transfer.aggregate import FinishedAggregator, with_finished
from stoker.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DistributedExecutor(Executor):
    def __init__(self, config: EngineConfig, hf_config: dict[str, Any], max_model_len: int) -> None:
        pc = config.parallel_config
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a tensor-parallel group: shut that engine down "
                               "(LLM.shutdown()) before starting another one with tensor_parallel_size > 1")
        self.procs: list[subprocess.Popen] = []
        self.tp: Any = None
        self._failure: str | None = None
        self._closing = False
        self._threads_before = torch.get_num_threads()
        # seq ids finished since the last step, for the other ranks' drafters (their per-sequence
        # state: skipped positions, EAGLE-3's carried rows); sent before the next step
        self._released: list[int] = []
        env = launch.Rendezvous.from_env()
        if env is not None:  # torchrun / Kubernetes started every rank
            if env.world_size != pc.tensor_parallel_size or env.rank != 0:
                raise ValueError(f"WORLD_SIZE {env.world_size} / RANK {env.rank} in the environment do not match "
                                 f"--tensor-parallel-size {pc.tensor_parallel_size} on the driver (rank 0)")
            given = [f for f, v, default in (("--nnodes", pc.nnodes, 1), ("--node-rank", pc.node_rank, 0),
                                             ("--master-port", pc.master_port, None)) if v != default]
            if given:  # the launcher's rendezvous (MASTER_ADDR/PORT, RANK) decides these
                raise ValueError(f"{', '.join(given)}: the launcher (torchrun, Kubernetes) already set the rendezvous "
                                 "in the environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); drop these flags")
            rdzv = env
        else:
            if pc.node_rank != 0:
                raise ValueError("only node 0 runs the engine; start the other nodes with --headless")
            if pc.nnodes > 1 and pc.master_port is None:
                raise ValueError("--nnodes > 1 needs --master-port (and --master-addr reachable from every node)")
            port = pc.master_port or launch.free_port(pc.master_addr)
            rdzv = launch.Rendezvous(pc.master_addr, port, pc.tensor_parallel_size, 0, 0)
            if config.device != "cuda" and launch.device_backend(config.device) == "gloo":
                torch.set_num_threads(launch.threads_per_rank(pc.ranks_per_node))
            self.procs = launch.spawn_workers(rdzv, list(pc.node_ranks)[1:], 1, config.device, pc.distributed_timeout_s,
                                              launch.threads_per_rank(pc.ranks_per_node))
            for rank, proc in zip(list(pc.node_ranks)[1:], self.procs):
                threading.Thread(target=self._watch, args=(proc, rank), name=f"stoker-tp-watch{rank}", daemon=True).start()
        logger.info("tensor parallelism: %d ranks over %d node(s), rendezvous %s:%d", rdzv.world_size, pc.nnodes,
                    rdzv.master_addr, rdzv.master_port)
        atexit.register(self.shutdown)  # no worker outlives this process, even if nobody calls shutdown
        try:
            self.tp = launch.init_group(rdzv, config.device, pc.distributed_timeout_s, waiting=self._raise_if_failed)
            self.tp.broadcast_object(("init", (config, hf_config, max_model_len)))
            self.driver_runner = ModelRunner(config, hf_config, max_model_len, self.tp)  # rank 0's shard
            self.tp.broadcast_object(("calibrate", None))
            self.collectives = CollectiveMonitor(self.tp, calibrate(self.tp, self.driver_runner.device))
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ failure
    def _watch(self, proc: subprocess.Popen, rank: int) -> None:
        """Note a spawned worker's exit (unless we are shutting down)."""
        code = proc.wait()
        if not self._closing:
            self._fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}")

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why
            logger.error("the engine is dead: %s", why)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)

    def _collective(self, what: str, fn: Any, *args: Any) -> Any:
        """Run a step of the protocol; any failure of it is the group's: the executor is dead."""
        self._raise_if_failed()
        try:
            return fn(*args)
        except Exception as exc:
            self._fail(f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise WorkerFailedError(self._failure) from exc

    # ------------------------------------------------------------------ executor contract
    def describe(self) -> RunnerInfo:
        return self.driver_runner.describe()

    def determine_num_blocks(self, max_num_batched_tokens: int) -> int:
        def agree() -> int:
            self.tp.broadcast_object(("num_blocks", max_num_batched_tokens))
            return self.tp.min_int(self.driver_runner.determine_num_blocks(max_num_batched_tokens))

        return self._collective("sizing the KV cache", agree)

    def initialize_cache(self, num_blocks: int) -> None:
        def allocate() -> None:
            self.tp.broadcast_object(("init_cache", num_blocks))
            self.driver_runner.allocate_kv_cache(num_blocks)
            self.driver_runner.capture_cuda_graphs()
            self.driver_runner.start_kv_connector()  # with a kv_transfer_config only (every rank starts its own)

        self._collective("allocating the KV cache", allocate)
        if self.driver_runner.kv_connector is not None:
            self.kv_finished = FinishedAggregator(self.tp.world_size)

    def execute(self, step: StepMessage) -> StepResult:
        self._send_released()
        if self.driver_runner.kv_connector is not None:
            return self._execute_with_connector(step)
        def forward() -> Any:
            self.tp.broadcast_object(("step", step.for_workers()))
            return self.driver_runner.forward(step)

        start = time.perf_counter()
        inputs, logits = self._collective("a tensor-parallel step", forward)
        self.collectives.after_step(time.perf_counter() - start)
        try:
            result = self.driver_runner.sample(step, inputs, logits)  # rank 0 alone: a failure here fails the batch only
        except Exception:
            # a runner drafter's loop runs on every rank (the others are in it already): it still runs, drafting nothing
            self._collective("drafting", self.driver_runner.draft, step, inputs, None)
            raise
        assert result is not None
        self._collective("drafting", self.driver_runner.draft, step, inputs, result)
        return result

    def _execute_with_connector(self, step: StepMessage) -> StepResult:
        """A step with a KV connector (stoker/kv_transfer/): every rank starts its part of the
        step's reads, runs the forward (none for a step of no sequences: a transfer poll), and
        reports what ended on it; rank 0 gathers the reports before sampling (so a sampling
        failure loses none) and merges them: a read or a lease ends once it has on every rank."""
        connector = self.driver_runner.kv_connector

        def forward_and_gather() -> Any:
            self.tp.broadcast_object(("step", step.for_workers()))
            self.driver_runner.copy_host_kv(step)  # before the reads: a block a read fills may be saved first
            connector.start_load_kv(step.kv_connector_meta)
            out = self.driver_runner.forward(step, host_kv_copied=True) if step.seqs else None
            return out, self.tp.gather_objects(connector.take_finished())

        start = time.perf_counter()
        out, parts = self._collective("a tensor-parallel step", forward_and_gather)
        if step.seqs:
            self.collectives.after_step(time.perf_counter() - start)
        result = self.driver_runner.sample(step, *out) if step.seqs else StepResult()
        assert result is not None
        return with_finished(result, self.kv_finished.merge(parts))

    def _send_released(self) -> None:
        """One message for all the sequences finished since the last step (the other ranks wait
        for the next message between steps, so it costs no extra round trip of a step)."""
        if self._released:
            released, self._released = self._released, []
            self._collective("a release of finished sequences", self.tp.broadcast_object, ("release", released))

    def release(self, seq_id: int) -> None:
        self.driver_runner.release(seq_id)  # sampling state lives on rank 0 only
        if self.driver_runner.drafter is not None:  # a runner drafter runs on every rank
            self._released.append(seq_id)

    def enable_structured_outputs(self, grammars: Any) -> None:
        self.driver_runner.enable_structured_outputs(grammars)  # rank 0 alone samples

    def expert_load(self) -> ExpertLoad | None:
        return self.driver_runner.expert_load()  # rank 0's counters: every rank routes every token

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Every rank copies its part of the adapter into the slot (the whole adapter travels:
        each rank cuts it as its base weights are cut, runner/lora.py)."""
        def load() -> None:
            self.tp.broadcast_object(("load_lora", (slot, adapter)))
            self.driver_runner.load_lora(slot, adapter)

        self._collective("loading a LoRA adapter", load)

    def clear_lora(self, slot: int) -> None:
        def clear() -> None:
            self.tp.broadcast_object(("clear_lora", slot))
            self.driver_runner.clear_lora(slot)

        self._collective("clearing a LoRA slot", clear)

    def check_health(self) -> None:
        self._collective("a ping of the tensor-parallel ranks", self.tp.broadcast_object, ("ping", None))

    def collective_summary(self) -> str | None:
        return self.collectives.summary()

    def shutdown(self) -> None:
        """Tell the workers to stop, then make sure they did (terminate, then kill)."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        if getattr(self, "driver_runner", None) is not None:
            self.driver_runner.close_kv_connector()
        if self.tp is not None and self._failure is None:
            try:
                self.tp.broadcast_object(("shutdown", None))
                if not self.tp.drain():
                    logger.warning("gloo still held the shutdown message after 5 s; exiting may abort")
            except Exception:
                logger.warning("could not tell the tensor-parallel workers to stop; stopping them", exc_info=True)
        for p in self.procs:
            _stop(p, graceful=self._failure is None)
        if self.tp is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:
                logger.debug("destroy_process_group", exc_info=True)
        torch.set_num_threads(self._threads_before)


def _stop(proc: subprocess.Popen, graceful: bool) -> None:
    """Wait for a worker to exit after the shutdown message; terminate, then kill, if it does not.
    After a failure nothing was sent and the worker may be hung (or stopped): kill it at once."""
    steps = ((None, 10.0), (proc.terminate, 5.0), (proc.kill, 5.0)) if graceful else ((proc.kill, 5.0),)
    for action, wait_s in steps:
        if action is not None:
            action()
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
