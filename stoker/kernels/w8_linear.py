"""Weight-only quantized GEMM: y = x @ dequantize(W)^T + bias, W stored as int8 or FP8 E4M3.

Twin: `reference.w8_linear`. For GPUs (and cases) where the W8A8 FP8 path does not apply:
INT8 weights, FP8 block-scaled weights, GPUs without FP8 matrix units. Decode is memory-
bound, so reading one byte per weight instead of two is the point; each (BLOCK_N, BLOCK_K)
tile of W is widened to x's dtype in registers and multiplied by its scales (one per row and
group of GROUP_K columns), exactly the dequantized weight the twin builds, then fed to
tl.dot with float32 accumulation.

Shapes: x (M, K) float16/bfloat16/float32 (rows contiguous), qweight (N, K) int8 or
float8_e4m3fn, scale (N, G) float32 with G = ceil(K / group_k), bias (N,) or None.
BLOCK_K divides group_k (or group_k >= K), so a K tile sits inside one scale group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import check, check_last_dim_contiguous, check_same_device, dot_args, next_pow2


@triton.jit
def _w8_linear_kernel(
    x_ptr,  # (M, K)
    w_ptr,  # (N, K) int8 / float8
    scale_ptr,  # (N, G) float32
    bias_ptr,  # (N,) or unused
    out_ptr,  # (M, N)
    M,
    N,
    K,
    group_k,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_mask = m < M
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_mask = k < K
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        s = tl.load(scale_ptr + n * stride_sn + k0 // group_k, mask=n_mask, other=0.0)  # (BLOCK_N,)
        w = q.to(tl.float32) * s[:, None]  # the dequantized weight, as the twin computes it
        if DOT_FP32:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def tile_config(num_rows: int, group_k: int, in_features: int) -> dict[str, int]:
    """Tiles by batch rows: decode (few rows) wants narrow M tiles and many N tiles to spread
    the weight reads over the SMs. 8 warps from 32 rows up: with 4, ptxas spilled the
    dequantized tile at M = 64 (tests/kernels/aot_sm90.py). Not yet tuned on a GPU."""
    block_m = max(16, min(64, next_pow2(num_rows)))
    block_k = 64
    while block_k > 16 and group_k < in_features and group_k % block_k:
        block_k //= 2
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 8 if block_m >= 32 else 4}


def w8_linear(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (N, K) int8 / float8_e4m3fn
    scale: torch.Tensor,  # (N, G) float32
    group_k: int,
    bias: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:  # (..., N) in x's dtype
    check(qweight.dim() == 2, f"qweight must be (N, K), got {tuple(qweight.shape)}")
    check(qweight.dtype in (torch.int8, torch.float8_e4m3fn), f"qweight must be int8 or float8_e4m3fn, got {qweight.dtype}")
    n, k = qweight.shape
    check(x.shape[-1] == k, f"x {tuple(x.shape)} does not fit qweight {tuple(qweight.shape)}")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x dtype {x.dtype}")
    groups = -(-k // group_k)
    check(scale.shape == (n, groups) and scale.dtype == torch.float32, f"scale must be ({n}, {groups}) float32, got {tuple(scale.shape)} {scale.dtype}")
    check(bias is None or bias.shape == (n,), f"bias must be ({n},)")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    for name, t in (("qweight", qweight), ("scale", scale)):
        check_last_dim_contiguous(name, t)
    check_same_device(x=rows, qweight=qweight, scale=scale)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], n)
    tiles = tile_config(rows.shape[0], group_k, k)
    check(group_k >= k or group_k % tiles["BLOCK_K"] == 0, f"group_k {group_k} must be a multiple of 16")
    dot_fp32, precision = dot_args(x.dtype)
    grid = (triton.cdiv(rows.shape[0], tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]))
    _w8_linear_kernel[grid](
        rows, qweight, scale, bias if bias is not None else scale, out,
        rows.shape[0], n, k, group_k if group_k < k else k + tiles["BLOCK_K"],
        rows.stride(0), qweight.stride(0), scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, DOT_FP32=dot_fp32, PRECISION=precision, **tiles,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
