"""KV store: scatter each new token's key and value into the paged cache via slot_mapping.

Twin: `reference.store_kvcache`. slot = block_id * block_size + offset; slot -1 marks a
padding token whose K/V are dropped. FP8 caches (float8_e4m3fn) store e4m3(clamp(x *
inverse scale, +-448)), the inverse scales rounded to float32 once on the host
(`kv_inverse_scales`), as the twin and the C kernel do. The E4M3 bits are made here with
integer arithmetic (`_e4m3_bits`), not by Triton's cast: the interpreter's float -> fp8 cast
does not carry a rounded-up mantissa into the exponent (1.9375 became 1.0, not 2.0), and the
same code on the GPU then writes the bytes the twin and the C kernel write. The -1 test happens in the kernel, so, unlike the twin,
the launcher never synchronises with the host (safe inside a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stoker.kernels._common import FLOAT_DTYPES, FP8_KV_DTYPE, FP8_MAX, check, check_last_dim_contiguous, check_same_device, kv_inverse_scales, next_pow2


@triton.jit
def _e4m3_bits(x):
    """float32 x with |x| <= 448 -> its E4M3 (e4m3fn) bits as uint8, rounding half to even."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # Subnormals are multiples of 2^-9: adding 2^23 to mag * 512 rounds it to an integer
    # (half to even) in the float add itself, and the integer is the low mantissa bits.
    sub = ((mag * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000) & 0xFF
    # Normals: keep 3 mantissa bits, rounding half to even on the 20 dropped; re-bias 127 -> 7.
    r = mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)
    normal = ((((r >> 23) - 120) << 3) | ((r >> 20) & 7)) & 0x7F
    return (sign | tl.where(mag < 0.015625, sub, normal)).to(tl.uint8)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,  # (T, Hkv, D)
    value_ptr,  # (T, Hkv, D)
    k_cache_ptr,  # (num_blocks, block_size, Hkv, D)
    v_cache_ptr,
    slot_mapping_ptr,  # (T,) int32/int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: block, slot-in-block, head (k and v caches share them)
    stride_cs,
    stride_ch,
    block_size,
    k_inv_scale,  # FP8 caches: 1 / k_scale, float32
    v_inv_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per token moves all Hkv * D elements of its key and value.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d  # (BLOCK_H, BLOCK_D)
    # float32 in registers either way (exact for 16-bit inputs): one type in both branches
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask).to(tl.float32)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask).to(tl.float32)
    if FP8:  # the caches are passed as uint8 views
        tl.store(k_cache_ptr + dst, _e4m3_bits(tl.clamp(k * k_inv_scale, -FP8_MAX, FP8_MAX)), mask=mask)
        tl.store(v_cache_ptr + dst, _e4m3_bits(tl.clamp(v * v_inv_scale, -FP8_MAX, FP8_MAX)), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64 (int32 accepted), -1 = skip
    k_scale: float = 1.0,  # FP8 caches only
    v_scale: float = 1.0,
) -> None:
    check(key.dim() == 3, f"key must be (T, Hkv, D), got {tuple(key.shape)}")
    check(value.shape == key.shape, f"value {tuple(value.shape)} must match key {tuple(key.shape)}")
    check(k_cache.dim() == 4, f"k_cache must be (num_blocks, block_size, Hkv, D), got {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    check(v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides")
    check(
        k_cache.shape[2:] == key.shape[1:],
        f"cache (.., Hkv, D) = {tuple(k_cache.shape[2:])} does not match key's {tuple(key.shape[1:])}",
    )
    check(slot_mapping.shape == (key.shape[0],), f"slot_mapping must be ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
    check(slot_mapping.dtype in (torch.int64, torch.int32), f"slot_mapping must be int64/int32, got {slot_mapping.dtype}")
    check(key.dtype in FLOAT_DTYPES and value.dtype == key.dtype, f"key/value dtypes {key.dtype}/{value.dtype}")
    check(k_cache.dtype in (*FLOAT_DTYPES, FP8_KV_DTYPE) and v_cache.dtype == k_cache.dtype, f"cache dtypes {k_cache.dtype}/{v_cache.dtype}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_inv, v_inv = kv_inverse_scales(k_scale, v_scale)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        k_inv,
        v_inv,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        FP8=fp8,
        FP8_MAX=FP8_MAX,
    )
