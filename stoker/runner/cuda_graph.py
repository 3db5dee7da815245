"""Decode CUDA graphs: one captured model forward per batch-size bucket.

A decode step launches a few kernels per layer on a few hundred tokens at most; at small
batch the GPU finishes each kernel faster than the host can launch the next, so the step
is launch-bound. Replaying a captured graph issues the whole forward as one launch.

How it fits the engine:
  * Static buffers (input_ids, positions, slot_mapping, block_tables, context_lens) are
    sized for the largest bucket and `max_model_len`; a captured graph reads them by address.
    Before each replay `fill_static_inputs` copies the step's (n,) decode inputs into their
    first n rows and pads rows n..bucket: slot_mapping -1 (store_kvcache skips the token),
    context_len 0 (the decode kernel reads no K/V and writes zeros), block-table row 0,
    token 0 at position 0.
  * The AttentionMetadata set while capturing holds views of those buffers, so the
    captured attention kernels read whatever the buffers hold at replay.
  * Only the model forward to the final hidden states is captured, into a static output;
    logits and sampling stay eager (their shapes follow the real batch).
  * Graphs exist only for pure-decode steps of at most the largest bucket; every other step
    (prefill, chunks, mixed batches, larger batches) runs eagerly.
  * Requirements, checked by `graphs_supported`: CUDA tensors served by compiled Triton
    kernels (the torch twins synchronise with the host; so does Triton's interpreter), and a
    decode-attention launch that depends on shapes only (it does: the split count is picked
    from B, Hkv and the block-table width).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from stoker.layers.attention import AttentionMetadata
from stoker.layers.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 24, 32, ... (steps of 8) up to min(max_num_seqs, max_size),
    that limit included, ascending. Padding a batch to its bucket wastes at most 7 rows."""
    limit = min(max_num_seqs, max_size)
    if limit < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `num_seqs` rows; None when it is larger than every bucket."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


@dataclass
class StaticInputs:
    """The buffers a captured graph reads; rows = the largest bucket."""

    input_ids: torch.Tensor  # (max_bs,) int64
    positions: torch.Tensor  # (max_bs,) int64
    slot_mapping: torch.Tensor  # (max_bs,) int64; -1 = padding row, not stored
    block_tables: torch.Tensor  # (max_bs, max_blocks_per_seq) int32
    context_lens: torch.Tensor  # (max_bs,) int32; 0 = padding row

    @classmethod
    def allocate(cls, max_bs: int, max_blocks_per_seq: int, device: torch.device) -> StaticInputs:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        static = cls(
            input_ids=zeros(max_bs, dtype=torch.int64),
            positions=zeros(max_bs, dtype=torch.int64),
            slot_mapping=zeros(max_bs, dtype=torch.int64),
            block_tables=zeros(max_bs, max_blocks_per_seq, dtype=torch.int32),
            context_lens=zeros(max_bs, dtype=torch.int32),
        )
        static.slot_mapping.fill_(-1)  # all rows start as padding
        return static

    def metadata(self, bs: int) -> AttentionMetadata:
        """Metadata of a pure-decode step of `bs` rows whose tensors ARE views of the buffers.

        Only the tensors reach the kernels in a pure-decode step; the host lists just say
        "bs sequences, one query token each" (their values are never read there)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            cu_seqlens_q=list(range(bs + 1)),
            context_lens_list=[1] * bs,
            num_decodes=bs,
        )


def fill_static_inputs(
    static: StaticInputs,
    bs: int,
    input_ids: torch.Tensor,  # (n,) int64
    positions: torch.Tensor,  # (n,) int64
    md: AttentionMetadata,  # of a pure-decode step of n <= bs sequences
) -> None:
    """Copy a decode step into rows 0..n of the buffers and make rows n..bs padding.

    Device-to-device copies on the current stream: no host sync. Rows past bs are left as
    they are (a graph of bucket bs never reads them)."""
    n = input_ids.shape[0]
    width = md.block_tables.shape[1]
    assert n <= bs <= static.input_ids.shape[0], (n, bs)
    assert width <= static.block_tables.shape[1], f"block table of {width} blocks > max_model_len's"
    static.input_ids[:n].copy_(input_ids)
    static.positions[:n].copy_(positions)
    static.slot_mapping[:n].copy_(md.slot_mapping)
    static.context_lens[:n].copy_(md.context_lens)
    static.block_tables[:n, :width].copy_(md.block_tables)
    # Entries past a row's context are never read (the kernel masks by context_len); zeroed
    # anyway so a row never points at blocks the sequence does not own.
    static.block_tables[:n, width:].zero_()
    if n < bs:
        static.input_ids[n:bs].zero_()
        static.positions[n:bs].zero_()
        static.slot_mapping[n:bs].fill_(-1)
        static.context_lens[n:bs].zero_()
        static.block_tables[n:bs].zero_()


def graphs_supported(device: torch.device) -> tuple[bool, str]:
    """(ok, why not): capture needs CUDA and compiled Triton kernels on it."""
    from stoker.kernels import ops
    from stoker.kernels._common import interpreting

    if device.type != "cuda":
        return False, f"device is {device.type}"
    if not ops.use_triton(torch.empty(0, device=device)):
        return False, "the Triton kernels are off (STOKER_DISABLE_TRITON) or triton is missing; the torch twins sync with the host"
    if interpreting():
        return False, "TRITON_INTERPRET=1: the interpreter copies tensors through the host"
    return True, ""


class CudaGraphRunner:
    """Captures `model`'s decode forward per bucket; `run` replays the one a step fits."""

    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.static = StaticInputs.allocate(self.sizes[-1], self.max_blocks_per_seq, device)
        self.output = torch.zeros(self.sizes[-1], hidden_size, dtype=dtype, device=device)  # (max_bs, hidden)
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, num_seqs: int, md: AttentionMetadata) -> bool:
        """A pure-decode step (one new token per sequence) that fits a captured bucket and
        whose block tables fit the static ones (always, while contexts stay <= max_model_len)."""
        is_pure_decode = md.num_decodes == len(md.context_lens_list) == num_seqs
        fits = 0 < num_seqs <= self.max_batch_size and md.block_tables.shape[1] <= self.max_blocks_per_seq
        return bool(self.graphs) and is_pure_decode and fits

    def _forward(self, bs: int) -> None:
        """The body that gets captured: static buffers in, static output out."""
        with set_forward_context(ForwardContext(self.static.metadata(bs))):
            hidden = self.model(self.static.input_ids[:bs], self.static.positions[:bs])  # (bs, hidden)
            self.output[:bs].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, all in one memory pool.

        Largest first: the pool grows once to the largest forward's needs and the smaller
        captures reuse it. Each bucket is run once eagerly on a side stream before its
        capture, so Triton compiles that shape's kernel variants outside the capture."""
        start = time.perf_counter()
        self.static.slot_mapping.fill_(-1)  # every row padding: warm-up and capture store nothing
        self.static.context_lens.zero_()
        with torch.cuda.device(self.device):  # graphs capture on the current device
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            for bs in reversed(self.sizes):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._forward(bs)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(bs)
                self.graphs[bs] = graph
            torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs in %.2f s (decode batch sizes %d..%d; larger batches and "
            "prefill run eagerly)", len(self.graphs), time.perf_counter() - start, self.sizes[0], self.sizes[-1],
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Replay the bucket's graph for this decode step -> (n, hidden), a view of the static
        output that the next replay overwrites (consume it before the next step)."""
        n = input_ids.shape[0]
        bs = bucket_for(n, self.sizes)
        assert bs is not None and bs in self.graphs, f"no graph for {n} sequences"
        fill_static_inputs(self.static, bs, input_ids, positions, md)
        self.graphs[bs].replay()
        return self.output[:n]
