"""Multi-LoRA update per token (punica's BGMV shape): out[t, cols] += (x[t] @ A[s].T) @ B[s].T for
the slot s = slot_ids[t] of each token (-1: the base model, nothing added).

One program per (token, block of output columns): it reads its token's row of x, computes the
R-wide shrink x @ A[s].T in registers (recomputed per column block: K x R, small beside the
block's B read) and adds the expand into its block of out. Only the token's own slot is read,
where the CPU path (layers/lora.py) multiplies every slot and masks: on a GPU the step is
memory-bound and each token's A/B come from L2 after the first token of that adapter.

Twin: `reference.lora_bgmv`. Shapes: x (T, K); A (S, R, K); B (S, N, R) with any strides (the
slot buffers are laid out (N, S, R) for the CPU path); out (T, >= col_offset + N) with unit
column stride; slot_ids (T,) int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import FLOAT_DTYPES, check, check_same_device, next_pow2


@triton.jit
def _lora_bgmv_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, slot_ptr,
    K, N, R,
    stride_xt, stride_as, stride_ar, stride_bs, stride_bn, stride_br, stride_ot, col_offset,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        s = slot.to(tl.int64)
        rr = tl.arange(0, BLOCK_R)
        xa = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # shrink: xa[r] = sum_k x[k] A[s, r, k]
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + kk, mask=kk < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + s * stride_as + rr[:, None] * stride_ar + kk[None, :],
                        mask=(rr[:, None] < R) & (kk[None, :] < K), other=0.0).to(tl.float32)
            xa += tl.sum(a * x[None, :], axis=1)
        nn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.load(b_ptr + s * stride_bs + nn[:, None] * stride_bn + rr[None, :] * stride_br,
                    mask=(nn[:, None] < N) & (rr[None, :] < R), other=0.0).to(tl.float32)
        delta = tl.sum(b * xa[None, :], axis=1)  # expand: (BLOCK_N,)
        o_ptrs = out_ptr + t * stride_ot + col_offset + nn
        o = tl.load(o_ptrs, mask=nn < N, other=0.0).to(tl.float32)
        tl.store(o_ptrs, (o + delta).to(out_ptr.dtype.element_ty), mask=nn < N)


def lora_bgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor,
              col_offset: int = 0) -> torch.Tensor:
    """In place: out[:, col_offset:col_offset + N] += per-token LoRA update; returns out."""
    check(x.dim() == 2 and a.dim() == 3 and b.dim() == 3, "x (T, K), A (S, R, K), B (S, N, R)")
    num_tokens, k = x.shape
    num_slots, r, ka = a.shape
    n = b.shape[1]
    check(ka == k and b.shape[0] == num_slots and b.shape[2] == r, f"shapes x {tuple(x.shape)}, A {tuple(a.shape)}, "
          f"B {tuple(b.shape)} do not chain")
    check(x.stride(1) == 1 and a.stride(2) == 1 and out.stride(1) == 1, "x, A and out need unit last-dim stride")
    check(slot_ids.shape == (num_tokens,) and slot_ids.dtype == torch.int32, "slot_ids must be (T,) int32")
    check(out.dim() == 2 and out.shape[0] == num_tokens and out.shape[1] >= col_offset + n, "out too narrow")
    check(x.dtype in FLOAT_DTYPES and out.dtype in FLOAT_DTYPES, f"dtypes x {x.dtype}, out {out.dtype}")
    check_same_device(x=x, a=a, b=b, out=out, slot_ids=slot_ids)
    if num_tokens == 0:
        return out
    block_n = 64
    grid = (num_tokens, triton.cdiv(n, block_n))
    _lora_bgmv_kernel[grid](
        x, a, b, out, slot_ids, k, n, r,
        x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), col_offset,
        BLOCK_K=min(128, next_pow2(k)), BLOCK_R=max(16, next_pow2(r)), BLOCK_N=block_n,
    )
    return out
