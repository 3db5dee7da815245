"""TP=1: one runner in this process, called directly (the step message is not copied)."""

from __future__ import annotations

from typing import Any

from stoker.config import EngineConfig
from stoker.core.expert_load import ExpertLoad
from stoker.core.step import StepMessage, StepResult
from stoker.executor.contract import Executor, RunnerInfo
from stoker.runner.model_runner import ModelRunner


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, hf_config: dict[str, Any], max_model_len: int) -> None:
        # This process's runner: the engine never touches it (it asks through the contract);
        # in-process tools and tests may (step timing, the doctor, model introspection).
        self.driver_runner = ModelRunner(config, hf_config, max_model_len)

    def describe(self) -> RunnerInfo:
        return self.driver_runner.describe()

    def determine_num_blocks(self, max_num_batched_tokens: int) -> int:
        return self.driver_runner.determine_num_blocks(max_num_batched_tokens)

    def initialize_cache(self, num_blocks: int) -> None:
        self.driver_runner.allocate_kv_cache(num_blocks)
        self.driver_runner.capture_cuda_graphs()  # CUDA and not enforce_eager only
        self.driver_runner.start_kv_connector()  # with a kv_transfer_config only

    def shutdown(self) -> None:
        self.driver_runner.close_kv_connector()

    def execute(self, step: StepMessage) -> StepResult:
        result = self.driver_runner.execute(step)
        assert result is not None, "rank 0 always returns the sampled tokens"
        return result

    def release(self, seq_id: int) -> None:
        self.driver_runner.release(seq_id)

    def load_lora(self, slot: int, adapter: Any) -> None:
        self.driver_runner.load_lora(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        self.driver_runner.clear_lora(slot)

    def enable_structured_outputs(self, grammars: Any) -> None:
        self.driver_runner.enable_structured_outputs(grammars)

    def expert_load(self) -> ExpertLoad | None:
        return self.driver_runner.expert_load()  # rank 0's counters: every rank routes every token
