"""Compile every kernel for an H100/H200 (sm_90) without a GPU, at the launchers' real tile
configs, and check with ptxas that none spills registers. Run by test_kernel_compile_sm90.py
in a subprocess, because Triton must be imported with TRITON_INTERPRET=0 for this.

    TRITON_INTERPRET=0 python tests/kernels/aot_sm90.py     # prints one line per kernel variant
    TRITON_INTERPRET=0 python tests/kernels/aot_sm90.py gemv_w4 gemv_w8   # only labels holding a word
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import warnings

os.environ["TRITON_INTERPRET"] = "0"
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from stoker.kernels import activation, paged_decode_attention, paged_prefill_attention, rms_norm, rotary  # noqa: E402
from stoker.kernels import fused_moe, mla_decode_attention, quant_gemv, store_kvcache, w4a16_linear, w8_linear  # noqa: E402
from stoker.kernels import tinygemm_int4  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"scale_log2", "eps", "v_scale", "k_inv_scale", "v_inv_scale", "cap_log2"}
FP8_CACHE = {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv", "cache_ptr": "fp8e4nv"}
TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def ptxas_path() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(TARGET.arch).path
    except Exception:  # noqa: BLE001 - another triton layout: skip the spill check
        return None


def spill_bytes(ptx: str, ptxas: str) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True, check=True
        ).stderr
    finally:
        os.unlink(f.name)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def compile_variant(fn, pointers: dict[str, str], constexprs: dict[str, object], num_warps: int,
                    divisible: "frozenset[str] | tuple[str, ...]" = ()) -> object:
    """pointers: argument name -> element type; '*' is the default for other *_ptr arguments.
    divisible: arguments a launch passes as multiples of 16 (pointers 16-byte aligned, integers
    divisible by 16), which the JIT specializes on (tt.divisibility 16) and which decide the
    loads' vector width, so kernels tuned for 16-byte loads compile here as on the GPU; "*": all."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, pointers["*"])
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name] != "constexpr" and (name in divisible or "*" in divisible)}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def variants():
    """(label, jit fn, pointer types, constexprs, num_warps[, divisible]) for the configs launchers pick."""
    idx = {"block_tables_ptr": "i32", "context_lens_ptr": "i32", "cu_seqlens_q_ptr": "i32"}
    part = {"part_out_ptr": "fp32", "part_lse_ptr": "fp32"}
    for fp8 in (False, True):
        yield (f"store_kvcache bf16 Hkv8 D128{' fp8 cache' if fp8 else ''}", store_kvcache._store_kvcache_kernel,
               {"*": "bf16", "slot_mapping_ptr": "i64", **({"k_cache_ptr": "u8", "v_cache_ptr": "u8"} if fp8 else {})},
               dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, FP8=fp8, FP8_MAX=448.0), 4)
    # soft_cap: Gemma 2's attention logit soft-capping (9B: head_dim 256, 2 query heads per KV head, a window)
    for dtype, head_dim, group, splits, window, soft_cap in [
        (torch.bfloat16, 128, 4, 1, False, False), (torch.bfloat16, 64, 8, 8, True, False),
        (torch.bfloat16, 256, 2, 4, False, False), (torch.float32, 128, 4, 2, False, False),
        (torch.bfloat16, 256, 2, 4, True, True),
    ]:
        tiles = paged_decode_attention.tile_config(head_dim, group, dtype)
        warps = tiles.pop("num_warps")
        yield (f"decode {TL[dtype]} D{head_dim} G{group} splits{splits}{' soft cap' if soft_cap else ''}",
               paged_decode_attention._decode_split_kernel, {"*": TL[dtype], **idx, **part},
               dict(GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits, USE_WINDOW=window, USE_SOFT_CAP=soft_cap,
                    DOT_FP32=False, PRECISION="ieee" if dtype == torch.float32 else "tf32", **tiles), warps)
    tiles = paged_decode_attention.tile_config(128, 4, torch.bfloat16)
    warps = tiles.pop("num_warps")
    yield ("decode bf16 D128 G4 splits4 fp8 cache", paged_decode_attention._decode_split_kernel,
           {"*": "bf16", **idx, **part, **FP8_CACHE},
           dict(GROUP=4, HEAD_DIM=128, NUM_SPLITS=4, USE_WINDOW=False, USE_SOFT_CAP=False, DOT_FP32=False,
                PRECISION="tf32", **tiles), warps)
    yield ("decode reduce D128 splits64", paged_decode_attention._decode_reduce_kernel, {"*": "bf16", **idx, **part},
           dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, NUM_SPLITS=64), 4)
    for dtype, head_dim, group, window, soft_cap in [
        (torch.bfloat16, 128, 4, True, False), (torch.bfloat16, 64, 1, False, False),
        (torch.bfloat16, 256, 2, False, False), (torch.bfloat16, 128, 7, False, False),
        (torch.float32, 128, 4, False, False), (torch.bfloat16, 256, 2, True, True),
    ]:
        tiles = paged_prefill_attention.tile_config(head_dim, group, dtype)
        warps = tiles.pop("num_warps")
        yield (f"prefill {TL[dtype]} D{head_dim} G{group}{' soft cap' if soft_cap else ''}",
               paged_prefill_attention._paged_prefill_kernel, {"*": TL[dtype], **idx},
               dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_B=256, USE_WINDOW=window, USE_SOFT_CAP=soft_cap,
                    DOT_FP32=False, PRECISION="ieee" if dtype == torch.float32 else "tf32", **tiles), warps)
    tiles = paged_prefill_attention.tile_config(128, 4, torch.bfloat16)
    warps = tiles.pop("num_warps")
    yield ("prefill bf16 D128 G4 fp8 cache", paged_prefill_attention._paged_prefill_kernel, {"*": "bf16", **idx, **FP8_CACHE},
           dict(GROUP=4, HEAD_DIM=128, BLOCK_B=256, USE_WINDOW=False, USE_SOFT_CAP=False, DOT_FP32=False,
                PRECISION="tf32", **tiles), warps)
    # absorbed MLA decode at DeepSeek-V3's latent (kv_lora_rank 512 + rope 64), and its reduce
    for dtype, splits, fp8 in ((torch.bfloat16, 1, False), (torch.bfloat16, 16, True), (torch.float32, 4, False)):
        tiles = mla_decode_attention.tile_config(512, 64, dtype)
        warps = tiles.pop("num_warps")
        yield (f"mla decode {TL[dtype]} r512 rope64 splits{splits}{' fp8 cache' if fp8 else ''}",
               mla_decode_attention._mla_decode_split_kernel, {"*": TL[dtype], "out_ptr": "fp32", **idx, **part, **(FP8_CACHE if fp8 else {})},
               dict(RANK=512, ROPE=64, NUM_SPLITS=splits, DOT_FP32=False,
                    PRECISION="ieee" if dtype == torch.float32 else "tf32", **tiles), warps)
    yield ("mla decode reduce r512 splits16", paged_decode_attention._decode_reduce_kernel, {"*": "fp32", **idx, **part},
           dict(HEAD_DIM=512, BLOCK_D=512, BLOCK_N=32, NUM_SPLITS=16), 4)
    for wtype, rows, group_k in (("i8", 1, 4096), ("fp8e4nv", 64, 128), ("i8", 256, 4096)):
        tiles = w8_linear.tile_config(rows, group_k, 4096)
        warps = tiles.pop("num_warps")
        yield (f"w8_linear {wtype} M{rows} group{group_k}", w8_linear._w8_linear_kernel,
               {"*": "bf16", "w_ptr": wtype, "scale_ptr": "fp32"},
               dict(HAS_BIAS=False, DOT_FP32=False, PRECISION="tf32", **tiles), warps)
    # W4A16 at Llama-3-8B shapes: decode (split K) and prefill tiles; float16 scales without
    # offsets (symmetric) and float32 scales with offsets (zero points, Q4_K minimums)
    for rows, n, k, group, asym in ((1, 4096, 4096, 128, False), (1, 1024, 4096, 32, True), (16, 14336, 4096, 64, False),
                                    (64, 4096, 14336, 128, True), (512, 4096, 4096, 32, False)):
        tiles = w4a16_linear.tile_config(rows, n, k, group, 132)
        warps = tiles.pop("num_warps")
        split = tiles.pop("SPLIT_K")
        yield (f"w4a16_linear M{rows} N{n} K{k} group{group}{' asym' if asym else ''} split{split}",
               w4a16_linear._w4a16_linear_kernel,
               {"*": "bf16", "w_ptr": "u8", "scale_ptr": "fp32" if asym else "fp16", "offset_ptr": "fp32",
                "out_ptr": "fp32" if split > 1 else "bf16"},
               dict(HAS_OFFSET=asym, HAS_BIAS=False, PARTIAL=split > 1, DOT_FP32=False, PRECISION="tf32", **tiles), warps)
    for split in (4, 16):
        yield (f"w4a16_linear split sum split{split}", w4a16_linear._split_sum_kernel, {"*": "bf16", "partial_ptr": "fp32"},
               dict(SPLIT_K=split, HAS_BIAS=True, BLOCK=w4a16_linear.SPLIT_SUM_BLOCK, RNE_BF16=False), 4)
    # decode GEMVs (quant_gemv.py) at Llama-3-8B shapes, compiled with the run-time specialization
    # of Llama's sizes (pointers aligned, N, K, strides and splits multiples of 16): M = 1, 2, 4, 8
    gemv_div = frozenset({"x_ptr", "w_ptr", "scale_ptr", "offset_ptr", "bias_ptr", "out_ptr", "N", "K", "half_k",
                          "bytes_per_split", "k_per_split", "group_k", "stride_xm", "stride_wn", "stride_om", "stride_os"})
    for rows, n, k, group, asym in ((1, 6144, 4096, 128, False), (2, 1024, 4096, 32, True), (4, 28672, 4096, 64, False),
                                    (8, 4096, 14336, 128, True), (1, 4096, 14336, 14336, False)):
        tiles = quant_gemv.tile_config(rows, n, k // 2, 4, 132)
        warps = tiles.pop("num_warps")
        split = tiles.pop("SPLIT_K")
        yield (f"gemv_w4 M{rows} N{n} K{k} group{group}{' asym' if asym else ''} split{split}", quant_gemv._gemv_w4_kernel,
               {"*": "bf16", "w_ptr": "u8", "scale_ptr": "fp32" if asym else "fp16", "offset_ptr": "fp32",
                "out_ptr": "fp32" if split > 1 else "bf16"},
               dict(HAS_OFFSET=asym, HAS_BIAS=not asym, PARTIAL=split > 1, RNE_BF16=False, **tiles), warps,
               gemv_div | ({"stride_sn"} if group <= 128 and k // group % 16 == 0 else set()))
    for wtype, rows, n, k, group in (("i8", 1, 6144, 4096, 4096), ("fp8e4nv", 1, 1024, 4096, 4096), ("i8", 4, 28672, 4096, 4096),
                                     ("fp8e4nv", 8, 4096, 14336, 128), ("i8", 2, 4096, 14336, 14336)):
        tiles = quant_gemv.tile_config(rows, n, k, 8, 132)
        warps = tiles.pop("num_warps")
        split = tiles.pop("SPLIT_K")
        yield (f"gemv_w8 {wtype} M{rows} N{n} K{k} group{group} split{split}", quant_gemv._gemv_w8_kernel,
               {"*": "bf16", "w_ptr": wtype, "scale_ptr": "fp32", "out_ptr": "fp32" if split > 1 else "bf16"},
               dict(INT8=wtype == "i8", HAS_BIAS=True, PARTIAL=split > 1, RNE_BF16=False, **tiles), warps, gemv_div)
    # the other launch configs benchmarks/w4a16_gpu.py --sweep times (quant_gemv.SWEEP_TILES), at
    # qkv (6144 x 4096, group 128 symmetric 4-bit; int8 per channel) for M = 1, 2 and 4
    for bits in (4, 8):
        for rows in (1, 2, 4):
            for overrides in quant_gemv.sweep_tiles(bits, rows)[1:]:
                tiles = quant_gemv.tile_config(rows, 6144, 4096 * bits // 8, bits, 132, **overrides)
                warps = tiles.pop("num_warps")
                split = tiles.pop("SPLIT_K")
                label = f"M{rows} VEC{tiles['VEC']} N{tiles['BLOCK_N']} warps{warps} split{split}"
                ptrs = {"*": "bf16", "scale_ptr": "fp32", "out_ptr": "fp32" if split > 1 else "bf16"}
                if bits == 4:
                    yield (f"gemv_w4 sweep {label}", quant_gemv._gemv_w4_kernel, {**ptrs, "w_ptr": "u8", "scale_ptr": "fp16", "offset_ptr": "fp32"},
                           dict(HAS_OFFSET=False, HAS_BIAS=False, PARTIAL=split > 1, RNE_BF16=False, **tiles), warps, gemv_div | {"stride_sn"})
                else:
                    yield (f"gemv_w8 sweep i8 {label}", quant_gemv._gemv_w8_kernel, {**ptrs, "w_ptr": "i8"},
                           dict(INT8=True, HAS_BIAS=False, PARTIAL=split > 1, RNE_BF16=False, **tiles), warps, gemv_div)
    for block_b, asym in ((quant_gemv.DEQUANT_BLOCK_B, False), (16, True)):
        yield (f"dequant_w4 BLOCK_B{block_b}{' asym' if asym else ''}", quant_gemv._dequant_w4_kernel,
               {"*": "bf16", "w_ptr": "u8", "scale_ptr": "fp32" if asym else "fp16", "offset_ptr": "fp32"},
               dict(HAS_OFFSET=asym, BLOCK_N=quant_gemv.DEQUANT_BLOCK_N, BLOCK_B=block_b, RNE_BF16=False), 4)
    yield ("dequant_tinygemm", tinygemm_int4._dequant_tinygemm_kernel,
           {"*": "bf16", "words_ptr": "i32", "table_ptr": "i32"},
           dict(TILES_N=tinygemm_int4.DEQUANT_BLOCK_N // tinygemm_int4.TILE_N, TILE_N_=tinygemm_int4.TILE_N, TILE_K_=tinygemm_int4.TILE_K,
                TILE_WORDS_=tinygemm_int4.TILE_WORDS, RNE_BF16=False), 4)
    # fused MoE on a Mixtral-8x7B-shaped layer (H 4096, I 14336, E 8, top-2): decode (2 pairs) and prefill
    moe_idx = {"sorted_ids_ptr": "i32", "block_expert_ptr": "i32", "num_padded_ptr": "i32", "scale_ptr": "fp32",
               "pair_weight_ptr": "fp32"}
    for wtype, group_k, num_pairs in (("bf16", 0, 2), ("bf16", 0, 512), ("i8", 0, 2), ("fp8e4nv", 128, 2), ("fp8e4nv", 128, 256)):
        gk13, gk2 = (group_k, group_k) if group_k else (4096 + 64, 14336 + 64)
        tiles = fused_moe.tile_config(num_pairs, 8, gk13, gk2, 4096, 14336)
        warps = tiles.pop("num_warps")
        common = dict(QUANT=wtype != "bf16", DOT_FP32=False, PRECISION="tf32", RNE_BF16=False, **tiles)
        yield (f"fused_moe gate_up {wtype} pairs{num_pairs}", fused_moe._moe_gate_up_kernel,
               {"*": "bf16", "w_ptr": wtype, **moe_idx}, dict(TOP_K=2, ACT=0, **common), warps)
        yield (f"fused_moe down {wtype} pairs{num_pairs}", fused_moe._moe_down_kernel,
               {"*": "bf16", "w_ptr": wtype, **moe_idx}, common, warps)
    yield ("fused_moe sum top2", fused_moe._moe_sum_kernel, {"*": "bf16"}, dict(TOP_K=2, BLOCK=1024, RNE_BF16=False), 4)
    # ---- begin fused_moe small-batch (GEMV-style) block ----
    # decode pair counts at the launcher's tiles: Mixtral-8x7B (H 4096, I 14336, 2 and 16 pairs),
    # Qwen3-30B-A3B (H 2048, I 768, 8 pairs); bf16 and float32 x, int8 per channel, fp8 128-column groups.
    # Every pointer and int argument 16-divisible, as at those shapes, so the loads are the vectorized ones
    for xtype, wtype, wbytes, group_k, hidden, inter, num_pairs in (
        ("bf16", "bf16", 2, 0, 4096, 14336, 2), ("bf16", "bf16", 2, 0, 4096, 14336, 16), ("bf16", "bf16", 2, 0, 2048, 768, 8),
        ("fp32", "fp32", 4, 0, 4096, 14336, 2), ("bf16", "i8", 1, 0, 4096, 14336, 2), ("bf16", "fp8e4nv", 1, 128, 4096, 14336, 2),
    ):
        gk13, gk2 = (group_k, group_k) if group_k else (hidden + 64, inter + 64)
        t = fused_moe.small_tile_config(num_pairs, wbytes, gk13, gk2, hidden, inter, 132)
        ptrs = {"*": xtype, "w_ptr": wtype, "scale_ptr": "fp32", "order_ptr": "i32", "ids_ptr": "i64",
                "partial_ptr": "fp32"}
        quant = wtype not in ("bf16", "fp32")
        label = f"{wtype} H{hidden} I{inter} pairs{num_pairs}"
        yield (f"fused_moe small gate_up {label} N{t['BLOCK_N13']} K{t['BLOCK_K13']}", fused_moe._moe_small_gate_up_kernel,
               ptrs, dict(TOP_K=2, QUANT=quant, ACT=0, BLOCK_N=t["BLOCK_N13"], BLOCK_K=t["BLOCK_K13"],
                          BITS_BF16=xtype == "bf16", RNE_BF16=False),
               t["num_warps"], ("*",))
        yield (f"fused_moe small down {label} N{t['BLOCK_N2']} K{t['BLOCK_K2']} split{t['SPLIT_K']}",
               fused_moe._moe_small_down_kernel, ptrs,
               dict(QUANT=quant, BLOCK_N=t["BLOCK_N2"], BLOCK_K=t["BLOCK_K2"], BITS_BF16=xtype == "bf16", RNE_BF16=False),
               t["num_warps"], ("*",))
    for split in (1, 4, 8):
        yield (f"fused_moe small sum top2 split{split}", fused_moe._moe_small_sum_kernel,
               {"*": "bf16", "partial_ptr": "fp32", "pair_weight_ptr": "fp32"},
               dict(TOP_K=2, SPLIT_K=split, BLOCK=1024, RNE_BF16=False), 4, ("*",))
    # ---- end fused_moe small-batch block ----
    for residual in (False, True):
        yield (f"rms_norm residual={residual} hidden8192", rms_norm._rms_norm_kernel, {"*": "bf16"},
               dict(HAS_RESIDUAL=residual, BLOCK=8192), 16)
    yield ("silu_and_mul", activation._silu_and_mul_kernel, {"*": "bf16"}, dict(BLOCK=1024), 4)
    for half, passed in ((64, 0), (32, 64)):
        yield (f"rotary rot_dim{2 * half} D128", rotary._rotary_kernel,
               {"*": "bf16", "positions_ptr": "i64", "cos_sin_ptr": "fp32"},
               dict(HALF=half, HEAD_DIM=128, BLOCK_H=32, BLOCK_HKV=8, BLOCK_HALF=half, BLOCK_PASS=passed), 4)


def main() -> int:
    ptxas = ptxas_path()
    failures = 0
    only = sys.argv[1:]  # words a label must hold one of (none: every variant but the sweep's)
    for label, fn, pointers, constexprs, warps, *divisible in variants():
        if only and not any(word in label for word in only):
            continue
        if " sweep " in label and "sweep" not in only:  # benchmark peers, not dispatched: only when asked
            continue
        try:
            kernel = compile_variant(fn, pointers, constexprs, warps, *divisible)
        except Exception as exc:  # noqa: BLE001 - report every variant, then fail
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:2000]}")
            failures += 1
            continue
        spills = spill_bytes(kernel.asm["ptx"], ptxas) if ptxas else -1
        status = "ok" if spills <= 0 else "SPILLS"
        failures += spills > 0
        print(f"{status} {label}: smem {kernel.metadata.shared} B, spill stores {spills if spills >= 0 else 'n/a'} B")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
