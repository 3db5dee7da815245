"""The NIXL connector's worker side: this rank's KV cache registered with NIXL, the side
channel that describes it, and the reads of a remote engine's blocks into it.

The cache is one (k, v) pair per layer, each (num_blocks, block_size, num_kv_heads, head_dim)
and contiguous, so block b of a tensor is the byte range [base + b * block_bytes, + block_bytes)
(an MLA latent cache has an empty v: one tensor per layer). A read of n blocks is, per tensor,
n (local, remote) regions, runs of consecutive block ids merged into one region. The pull
model, as vLLM's NixlConnector: the decode engine READs; the read carries a notification
naming the prefill engine's request, on which the prefill engine frees its blocks.

Tensor parallelism (equal TP on both sides): every rank runs one of these over its own heads,
with its own NIXL agent and its own side channel (the engine's port + rank). Rank r of a
decode engine handshakes with rank r of the prefill engine and reads that rank's blocks; each
rank reports what ended (`take_finished`) and rank 0 merges the ranks' reports
(aggregate.py) before the scheduler hears of them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stoker.core.step import StepMessage, StepResult
from stoker.kv_transfer import compat
from stoker.kv_transfer.aggregate import with_finished
from stoker.kv_transfer.base import KVConnectorWorker
from stoker.kv_transfer.config import KVTransferConfig
from stoker.kv_transfer.metadata import ConnectorMeta, LoadSpec, RankFinished, TransferReport
from stoker.kv_transfer.side_channel import SideChannelServer, handshake
from stoker.kv_transfer.transport import KVTransport, NixlTransport, Region

if TYPE_CHECKING:
    from stoker.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    name: str  # the transport's name for it
    regions: list[Region]  # (base address, bytes per block) per cache tensor, in layer order
    num_blocks: int


@dataclass
class _Read:
    handle: Any
    started: float
    num_bytes: int


def _merged(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, blocks) runs where both ids advance by one."""
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == rb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    return runs


class NixlWorkerConnector(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 compat_fields: dict[str, Any], transport: KVTransport | None = None, tp_rank: int = 0) -> None:
        self.config = config
        self.compat_fields = compat_fields
        self.tp_rank = tp_rank
        tensors = [t for k, v in kv_caches for t in (k, v) if t.numel()]
        assert tensors and all(t.is_contiguous() for t in tensors), "the KV cache tensors must be contiguous"
        self.num_blocks = tensors[0].shape[0]
        self.mem_type = "VRAM" if tensors[0].is_cuda else "DRAM"
        # (base, bytes per block) per tensor: block b is [base + b * bytes, base + (b + 1) * bytes)
        self.regions: list[Region] = [(t.data_ptr(), t[0].numel() * t.element_size()) for t in tensors]
        if transport is None:
            backends = tuple(config.kv_connector_extra_config.get("backends", ("UCX",)))
            transport = NixlTransport(f"stoker-{config.engine_id}-{tp_rank}", backends)
            faults = config.kv_connector_extra_config.get("faults")
            if faults:
                from stoker.kv_transfer.faults import FaultyTransport

                transport = FaultyTransport(transport, faults)
        self.transport = transport
        self.transport.register([(base, size * self.num_blocks) for base, size in self.regions], self.mem_type)
        self._metadata = base64.b64encode(self.transport.metadata()).decode()
        self.peers: dict[str, _Peer] = {}
        self.reads: dict[str, _Read] = {}  # this engine's request id ->
        self.report = TransferReport()
        port = config.side_channel_port + tp_rank  # each rank answers for its own heads
        self.side_channel = SideChannelServer(config.side_channel_host, port, self._answer) if config.is_producer else None
        logger.info("NixlConnector %s: %d cache tensors x %d blocks registered (%s), compat %s",
                    config.engine_id, len(self.regions), self.num_blocks, self.mem_type, compat.compat_hash(compat_fields))

    # ------------------------------------------------------------------ the holder's side
    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"engine_id": self.config.engine_id, "tp_rank": self.tp_rank, "agent_metadata": self._metadata,
                "layout": {"regions": self.regions, "num_blocks": self.num_blocks},
                "compat": self.compat_fields, "compat_hash": compat.compat_hash(self.compat_fields)}

    # ------------------------------------------------------------------ hooks
    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, ConnectorMeta):
            return
        for load in meta.loads:
            try:
                self._start(load)
            except Exception as exc:  # noqa: BLE001 - a failed read fails its request, not the step
                logger.warning("request %s: KV read from %s:%d failed to start: %s", load.request_id,
                               load.remote_host, load.remote_port, exc)
                self.report.failed_recving[load.request_id] = str(exc)
                self.peers.pop(load.remote_engine_id, None)  # handshake again next time (a restarted engine)

    def get_finished(self) -> tuple[set[str], set[str]]:
        recving: set[str] = set()
        for request_id, read in list(self.reads.items()):
            state = self.transport.state(read.handle)
            now = time.monotonic()
            if state == "PROC" and now - read.started < self.config.load_timeout_s:
                continue
            del self.reads[request_id]
            if state == "DONE":
                recving.add(request_id)
                self.report.transfers[request_id] = (now - read.started, read.num_bytes)
            else:
                why = "the transfer failed" if state == "ERR" else f"no answer within {self.config.load_timeout_s:g} s"
                self.report.failed_recving[request_id] = f"NIXL read: {why}"
            try:
                self.transport.release(read.handle)
            except Exception:  # noqa: BLE001 - a handle of a failed transfer may refuse release
                logger.debug("releasing a NIXL handle failed", exc_info=True)
        sending = {n.decode() for n in self.transport.notifications()}
        return sending, recving

    def take_finished(self) -> RankFinished:
        """What ended on this rank since the last call (get_finished and the report)."""
        sending, recving = self.get_finished()
        report, self.report = self.report, TransferReport()
        return RankFinished(frozenset(sending), frozenset(recving), report)

    def around_step(self, runner: ModelRunner, step: StepMessage) -> StepResult | None:
        """The runner's step with the connector around it: reads start before the forward,
        completions ride back on the result (a step of no sequences only polls). Under TP the
        executor collects every rank's `take_finished` instead (executor/distributed.py)."""
        runner.copy_host_kv(step)  # before the reads: a block a read fills may be one this step saves to host
        self.start_load_kv(step.kv_connector_meta)
        if step.seqs:
            result = runner.sample(step, *runner.forward(step, host_kv_copied=True))
        else:
            result = StepResult() if runner.tp.is_first else None
        self.wait_for_save()
        if result is None or runner.tp.world_size > 1:
            return result
        return with_finished(result, self.take_finished())

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        self.transport.close()

    # ------------------------------------------------------------------ the reader's side
    def _peer(self, load: LoadSpec) -> _Peer:
        peer = self.peers.get(load.remote_engine_id)
        if peer is not None:
            return peer
        port = load.remote_port + self.tp_rank  # the same rank of the prefill engine holds the same heads
        try:
            reply = handshake(load.remote_host, port, {"engine_id": self.config.engine_id, "tp_rank": self.tp_rank})
        except OSError as exc:
            raise RuntimeError(f"cannot reach the prefill engine's NIXL side channel at {load.remote_host}:"
                               f"{port} ({exc})") from None
        difference = compat.first_difference(self.compat_fields, reply.get("compat") or {})
        if difference is not None:
            raise RuntimeError(difference)
        if reply.get("engine_id") != load.remote_engine_id or reply.get("tp_rank", 0) != self.tp_rank:
            raise RuntimeError(f"the side channel at {load.remote_host}:{port} is engine {reply.get('engine_id')!r} "
                               f"rank {reply.get('tp_rank', 0)}, not {load.remote_engine_id!r} rank {self.tp_rank}")
        name = self.transport.add_peer(base64.b64decode(reply["agent_metadata"]))
        layout = reply["layout"]
        peer = _Peer(name, [tuple(r) for r in layout["regions"]], int(layout["num_blocks"]))
        self.peers[load.remote_engine_id] = peer
        return peer

    def _start(self, load: LoadSpec) -> None:
        peer = self._peer(load)
        if len(load.local_block_ids) != len(load.remote_block_ids):
            raise RuntimeError(f"{len(load.local_block_ids)} local blocks for {len(load.remote_block_ids)} remote ones")
        if any(not 0 <= b < peer.num_blocks for b in load.remote_block_ids):
            raise RuntimeError(f"remote block ids {list(load.remote_block_ids)} outside the remote cache's {peer.num_blocks}")
        local: list[Region] = []
        remote: list[Region] = []
        runs = _merged(list(load.local_block_ids), list(load.remote_block_ids))
        for (lbase, size), (rbase, rsize) in zip(self.regions, peer.regions):
            for lb, rb, n in runs:
                local.append((lbase + lb * size, n * size))
                remote.append((rbase + rb * rsize, n * size))
        num_bytes = sum(n for _, n in local)
        started = time.monotonic()  # before the post: a small read may complete inside it
        handle = self.transport.read(peer.name, local, remote, self.mem_type, load.remote_request_id.encode())
        self.reads[load.request_id] = _Read(handle, started, num_bytes)


def compat_fields(runner: ModelRunner) -> dict[str, Any]:
    """What must agree between two engines that exchange blocks (compat.FIELDS)."""
    hf = {k: v for k, v in sorted(runner.hf_config.items()) if not k.startswith("_")}
    model = hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest()[:12]
    arch = (runner.hf_config.get("architectures") or ["?"])[0]
    spec = runner.kv_spec
    layers = runner.model.attention_layers()
    scales = [(float(a.k_scale), float(a.v_scale)) for a in layers]
    version = sys.modules["stoker"].__version__  # the package is loaded (this module is in it); no import upward
    return {"stoker_version": version, "model": f"{arch}:{model}", "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_dtype": spec.dtype, "kv_scales": compat.scales_digest(scales), "block_size": runner.block_size,
            "num_layers": len(layers), "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "kv_tensors": spec.kv_tensors, "tp_size": runner.tp.world_size}


def start_worker_connector(runner: ModelRunner) -> NixlWorkerConnector:
    config = runner.config.kv_transfer_config
    assert config is not None
    return NixlWorkerConnector(config, runner.kv_caches, compat_fields(runner), tp_rank=runner.tp.rank)
