"""MXFP4 Mixture-of-Experts experts (gpt-oss's checkpoints), held 4-bit as the checkpoint
stores them and dequantized one routed expert at a time in the forward:

    w13_blocks (E, 2I, H / 32, 16) uint8   each expert's [gate; up] rows, two E2M1 values a byte
    w13_scales (E, 2I, H / 32)     uint8   E8M0 exponents, one per block of 32 values of a row
    w2_blocks  (E, H, I / 32, 16)  uint8
    w2_scales  (E, H, I / 32)      uint8

0.5 + 1/32 bytes a weight (4.25 bits), against 2 in bf16: gpt-oss-20b's experts are ~12 GB
in bf16 and ~3.2 GB here. The weight a value stands for is E2M1[nibble] * 2^(scale - 127)
(quantization/formats.dequantize_mxfp4, the one definition; transformers' mxfp4 integration
computes the same). The biases (gpt-oss's) stay in the model dtype (`MoEMethod.create_biases`).

Loading: shards `(expert, "w1" | "w3" | "w2")` with parameters "blocks" and "scales"
(models/gpt_oss_loading.py de-interleaves gate and up rows). Expert parallelism reads only
this rank's experts. Tensor parallelism cuts I at block boundaries: each rank reads its rows
of gate and up (whole rows of blocks) and its blocks of each down row, so I / tp must be a
multiple of 32 (refused by name otherwise, with --enable-expert-parallel as the way out).

Backends, chosen once at build (models/method_chooser.py):
  cpu      CPU float32 with the C kernels: the one-call MoE kernel reading the blocks
           (kernels/cpu/moe.c, `stoker_fused_moe_mxfp4_f32`): each GEMM task dequantizes its
           panel into a per-thread buffer and runs the linear kernel's task on it, so the
           result is the float kernel's on the dequantized weights, bit for bit.
  dequant  anything else (CUDA included): each routed expert's w13 and w2 dequantized in torch
           into the model dtype for that call (2I x H + H x I values), then the float expert's
           GEMMs. Correct, not fast: the dequantized copy is a temporary written per call.
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.layers.moe import EXPERT_SHARDS, FusedMoE, MoEMethod
from stoker.layers.weight_method import expect_shape
from stoker.quantization import formats

_BLOCK, _BYTES = formats.MXFP4_BLOCK, formats.MXFP4_BYTES_PER_BLOCK


MXFP4_BACKENDS = ("cpu", "dequant")


class Mxfp4MoEMethod(MoEMethod):
    kind = "mxfp4"
    graph_capturable = False  # the per-expert loop reads token counts on the host, as the float one

    def __init__(self, backend: str = "dequant") -> None:
        if backend not in MXFP4_BACKENDS:
            raise ValueError(f"unknown MXFP4 MoE backend {backend!r}; one of {MXFP4_BACKENDS}")
        self.backend = backend
        self.activation: str | None = None  # the C kernel's name for the layer's gate (create_weights)

    def describe(self) -> str:
        return f"experts mxfp4 via {self.backend}"

    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        if h % _BLOCK:
            raise ValueError(f"MXFP4 experts need hidden_size ({h}) to be a multiple of {_BLOCK} (its block size)")
        if i % _BLOCK:
            per_rank = f" per rank (intermediate_size {layer.checkpoint_intermediate_size} / tensor_parallel_size " \
                       f"{layer.split.num_parts} = {i}); --enable-expert-parallel keeps experts whole" if layer.is_split else ""
            raise ValueError(f"MXFP4 experts need intermediate_size ({i}) to be a multiple of {_BLOCK} (its block "
                             f"size){per_rank}")
        layer.w13_blocks = nn.Parameter(torch.zeros(e, 2 * i, h // _BLOCK, _BYTES, dtype=torch.uint8), requires_grad=False)
        layer.w13_scales = nn.Parameter(torch.zeros(e, 2 * i, h // _BLOCK, dtype=torch.uint8), requires_grad=False)
        layer.w2_blocks = nn.Parameter(torch.zeros(e, h, i // _BLOCK, _BYTES, dtype=torch.uint8), requires_grad=False)
        layer.w2_scales = nn.Parameter(torch.zeros(e, h, i // _BLOCK, dtype=torch.uint8), requires_grad=False)
        self.create_biases(layer)
        if self.backend == "cpu":
            from stoker.layers.activation import ClampedSwiGLU

            self.activation = "silu" if layer.is_silu else "swigluoai" if isinstance(layer.act, ClampedSwiGLU) else None
            if self.activation is None:
                self.backend = "dequant"  # moe.c applies SiLU or the clamped SwiGLU; another gate runs in torch

    def checkpoint_params(self) -> tuple[str, ...]:
        return ("blocks", "scales")

    def checkpoint_slice(
        self, layer: FusedMoE, shard: str, param: str, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        if param == "bias":
            return layer.bias_slice(shard, shape)
        if not layer.is_split:
            return None
        start, stop = layer.split.range(layer.checkpoint_intermediate_size)  # multiples of 32 (create_weights)
        if shard == "w2":  # (H, I / 32, 16) or (H, I / 32): this rank's blocks of each row
            return (slice(None), slice(start // _BLOCK, stop // _BLOCK))
        return (slice(start, stop),)  # gate / up (I, H / 32, ...): this rank's rows

    def load(self, layer: FusedMoE, expert: int, shard: str, tensor: torch.Tensor, param: str = "weight") -> None:
        if param == "bias":
            return self.load_bias(layer, expert, shard, tensor)
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} does not exist: the config has num_experts {layer.num_experts}")
        where = f"expert {expert} {shard} {param}"
        if param not in ("blocks", "scales"):
            raise ValueError(f"{where}: an mxfp4 checkpoint (quantization_config quant_method mxfp4) holds its experts "
                             f"as *_blocks and *_scales, not {param!r}")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"{where} is {tensor.dtype}; MXFP4 {param} are uint8")
        i = layer.intermediate_size
        rows = {"w1": slice(0, i), "w3": slice(i, 2 * i), "w2": slice(0, layer.hidden_size)}[shard]
        stacked = getattr(layer, f"{'w2' if shard == 'w2' else 'w13'}_{param}")
        target = stacked[expert, rows]  # (N, G, 16) or (N, G)
        expect_shape(tuple(tensor.shape), tuple(target.shape), f"expert {expert} {param}", shard)
        with torch.no_grad():
            target.copy_(tensor)

    def process_after_loading(self, layer: FusedMoE) -> None:
        if self.backend == "cpu" and layer.has_bias:
            from stoker.kernels.cpu import moe as cpu_moe

            # (E, P * NR): padded to the panels, as the kernel's GEMM tasks read a bias
            layer.w13_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w13_bias.data), requires_grad=False)
            layer.w2_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w2_bias.data), requires_grad=False)

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H) -> (T, H)
        if self.backend != "cpu":
            return super().apply(layer, x, topk_weights, topk_ids)
        from stoker.kernels.cpu import moe as cpu_moe

        b13, b2 = (layer.w13_bias, layer.w2_bias) if layer.has_bias else (None, None)
        alpha, limit = (layer.act.alpha, layer.act.limit) if self.activation == "swigluoai" else (0.0, 0.0)
        return cpu_moe.fused_moe_mxfp4(x, layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales,
                                       topk_weights, topk_ids, b13, b2, self.activation or "silu", alpha, limit)

    def expert_forward(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        w13 = formats.dequantize_mxfp4(layer.w13_blocks[e], layer.w13_scales[e], rows.dtype)  # (2I, H)
        w2 = formats.dequantize_mxfp4(layer.w2_blocks[e], layer.w2_scales[e], rows.dtype)  # (H, I)
        if layer.has_bias:
            return layer.act(rows @ w13.t() + layer.w13_bias[e]) @ w2.t() + layer.w2_bias[e]
        return layer.act(rows @ w13.t()) @ w2.t()
