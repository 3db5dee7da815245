"""The KV connector seam, with the hook names of vLLM's KVConnectorBase_V1. [no torch]

Two sides, as in vLLM: the scheduler side lives beside the scheduler (pure Python, keyed by
requests and block ids); the worker side lives beside the runner and its KV tensors (one per
tensor-parallel rank). They speak only through the step round trip (DESIGN.md, seam 21):
`build_connector_meta` -> StepMessage.kv_connector_meta -> `start_load_kv`, and
`get_finished` -> StepResult.finished_sending / finished_recving ->
`Scheduler.update_after_step`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from stoker.core.sequence import Sequence


class KVConnectorScheduler(ABC):
    """Scheduler side: admission, the per-step metadata, and finish."""

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past num_computed_tokens that a remote engine holds, whether they load
        asynchronously: the sequence then waits in WAITING_FOR_REMOTE_KV)."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_local_blocks: int) -> None:
        """seq was given block_ids; the first num_local_blocks came from the local prefix cache
        (then the host KV tier, loaded this step), the rest are to be filled from the remote engine."""

    @abstractmethod
    def build_connector_meta(self) -> Any:
        """This step's metadata for the worker side (the reads to start)."""

    @abstractmethod
    def request_finished(self, seq: Sequence) -> bool:
        """seq finished or was aborted: True when its blocks must outlive it (a remote reader's
        lease, or a read still writing into them); the connector frees them later."""


class KVConnectorWorker(ABC):
    """Worker side: moves K/V between this rank's cache and a remote engine's."""

    @abstractmethod
    def start_load_kv(self, meta: Any) -> None:
        """Before the forward: start this step's reads."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: its K/V has arrived. Pull-model connectors load whole
        requests before scheduling them, so nothing is ever waited for inside a forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """After a layer's attention: push its new K/V. Pull-model connectors save nothing:
        the reader reads the blocks where they are."""

    def wait_for_save(self) -> None:
        """After the forward: every save of this step has left."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(request ids whose blocks the remote reader is done with, request ids whose reads
        arrived) since the last call."""
