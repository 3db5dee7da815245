"""Python entry point of lora.c (float32): argument checks, then one ctypes call.

`lora` has the semantics of its twin reference.lora_segments; layers/lora.py calls it for CPU
float32 activations. The C code trusts its indices, so everything that could make it read or
write outside a tensor is checked here first.
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu.common import _checked_library


def lora(
    x: torch.Tensor,  # (T, K) float32, unit column stride
    a: torch.Tensor,  # (S, W, K) every slot's A, shards stacked along W
    bt: torch.Tensor,  # (S, W, N) every slot's expand, transposed, zero outside `blocks`
    segments: torch.Tensor,  # (G, 3) int64: slot, first token, end token
    blocks: torch.Tensor,  # (E, 4) int64: rank rows [w0, w1) reach output columns [n0, n1)
    ranks: torch.Tensor,  # (S,) int64: the rows of each block the adapter in the slot fills
    out: torch.Tensor,  # (T, >= N) float32, updated in place
) -> torch.Tensor:
    """out[t] += (x[t] @ A[s].T) @ BT[s] for the tokens of each segment (lora.c)."""
    num_slots, w, k = a.shape
    n = bt.shape[2]
    if x.dim() != 2 or x.shape[1] != k or bt.shape[:2] != (num_slots, w) or out.shape[0] != x.shape[0] or out.shape[1] < n:
        raise ValueError(f"lora: x {tuple(x.shape)}, A {tuple(a.shape)}, BT {tuple(bt.shape)}, out {tuple(out.shape)} do not chain")
    if not all(t.dtype == torch.float32 for t in (x, a, bt, out)) or not (a.is_contiguous() and bt.is_contiguous()):
        raise ValueError("lora needs float32 tensors and contiguous slot buffers")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("lora needs x and out with unit column stride")
    for t in (segments, blocks, ranks):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError("lora's segments, blocks and ranks must be contiguous int64")
    if int(segments.shape[0]) == 0:
        return out
    status = _checked_library().stoker_lora_f32(
        x.data_ptr(), x.stride(0), k, a.data_ptr(), bt.data_ptr(), w, n, segments.data_ptr(), segments.shape[0],
        blocks.data_ptr(), blocks.shape[0], ranks.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("lora: could not allocate its scratch buffer")
    return out
