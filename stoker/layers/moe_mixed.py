"""Mixture-of-Experts experts held per projection: gate/up and down each as int4 or int8 codes
with a scale and an offset per group (w = q * scale + offset, quantization/int4.py's form).

What a GGUF MoE layer whose experts fit neither one-representation method is, exactly
(quantization/gguf.py `expert_projections` decides it per layer): llama-quantize's Q4_K_M and
Q4_K_S files give the "more bits" layers' ffn_down_exps Q6_K / Q5_K (Q5_0 / Q8_0 where rows are
not whole super-blocks) beside Q4_K gate/up, and Q5_K_M files hold Q5_K gate/up (5-bit codes with
offsets) beside a Q5_K or Q6_K down. Each projection keeps its type's own codes:

    w13         (E, 2I, H / 2) uint8 (int4: two codes a byte, int4.pack) or (E, 2I, H) int8
    w13_scale   (E, 2I, H / g13) float32
    w13_offset  (E, 2I, H / g13) float32   (a symmetric type's: 0; Q4_0's -8 d, as decoded)
    w2          (E, H, I / 2) uint8 or (E, H, I) int8
    w2_scale    (E, H, I / g2)  float32
    w2_offset   (E, H, I / g2)  float32

int4: Q4_0, Q4_1, Q4_K (groups of 32); int8: Q8_0 (32), Q6_K (16), Q5_0 (32) with offsets 0,
Q5_K and Q5_1 (codes 0..31, 32). Every product q * scale is exact in float32 (at most 8-bit codes
times an fp16 x 8-bit scale), so q * scale, rounded, + offset, rounded is gguf-py's dequantize bit
for bit. Gate and up share one representation (their group the finer of theirs, the coarser
scales and offsets repeated: exact).

Loading: models/gguf_loader.py gives each expert's `weight` (N, K) codes (uint8 in [0, 15] for
int4, int8 otherwise), `weight_scale` and `weight_offset` (N, K / g); tensor parallelism cuts I
(gate and up by rows, down by columns at whole groups of g2, checked at build).

Backends, chosen once at build (models/method_chooser.py):
  cpu      CPU float32 with the C kernels: the one-call MoE kernel (kernels/cpu/moe.c,
           `stoker_fused_moe_coded_f32`) on each projection's codes, scales and offsets in
           panels (kernels/cpu/moe.pack_coded_experts), each GEMM task dequantizing its panel from
           4- or 8-bit codes (a vector loop along NR) and running the linear kernel's task on it:
           the float experts' result on the dequantized weights, bit for bit, as the int4 MoE
           method's; no per-expert Python loop.
  dequant  anything else (CUDA included): each routed expert's w13 and w2 dequantized in torch
           for that call, then the float expert's GEMMs. Correct, not fast.
The weight bytes are the file's types' as held: int8 projections one byte a weight (a Q6_K down
6.56 bits a weight in the file, 8 here) plus 8 bytes a group.
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.layers.moe import EXPERT_SHARDS, FusedMoE, MoEMethod
from stoker.quantization import int4
from stoker.quantization.config import WeightScheme

MIXED_MOE_BACKENDS = ("cpu", "dequant")


class MixedMoEMethod(MoEMethod):
    kind = "mixed"
    graph_capturable = False  # the per-expert loop reads token counts on the host, as the float one

    def __init__(self, w13: WeightScheme, w2: WeightScheme, backend: str = "dequant", name: str = "experts") -> None:
        if backend not in MIXED_MOE_BACKENDS:
            raise ValueError(f"unknown mixed MoE backend {backend!r}; one of {MIXED_MOE_BACKENDS}")
        for what, s in (("gate/up", w13), ("down", w2)):
            if s.dtype not in ("int4", "int8") or s.strategy != "group":
                raise ValueError(f"{name}: MixedMoEMethod holds int4 or int8 groups, not {s.dtype} {s.strategy} "
                                 f"({what})")
        self.schemes = {"w13": w13, "w2": w2}
        self.bits = {w: 4 if s.dtype == "int4" else 8 for w, s in self.schemes.items()}
        self.group = {w: int(s.group_size or 0) for w, s in self.schemes.items()}
        self.backend = backend
        self.name = name
        self.activation: str | None = None  # the C kernel's name for the layer's gate (create_weights)

    def describe(self) -> str:
        parts = [f"{what} {self.schemes[w].dtype} group {self.group[w]}"
                 for what, w in (("gate/up", "w13"), ("down", "w2"))]
        return f"experts {', '.join(parts)} via {self.backend}"

    # ---------------------------------------------------------------- parameters
    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        _whole_groups(h, self.group["w13"], f"{self.name} gate/up (hidden_size {h})")
        if layer.is_split:
            start, stop = layer.split.range(layer.checkpoint_intermediate_size)
            g = self.group["w2"]
            if start % g or (stop - start) % g:
                raise ValueError(
                    f"{self.name}: tensor parallelism gives this rank columns [{start}, {stop}) of the experts' "
                    f"intermediate_size {layer.checkpoint_intermediate_size}, which splits a group of {g} of the "
                    "down projection; choose a tensor_parallel_size whose parts are whole groups, or "
                    "--enable-expert-parallel (whole experts per rank)")
        _whole_groups(i, self.group["w2"], f"{self.name} down (intermediate_size {i} on this rank)")
        for w, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            if self.bits[w] == 4:
                if k % 2:
                    raise ValueError(f"{self.name}: int4 weights pack two columns to a byte; K {k} of {w} must be even")
                codes = torch.zeros(e, n, k // 2, dtype=torch.uint8)
            else:
                codes = torch.zeros(e, n, k, dtype=torch.int8)
            groups = k // self.group[w]
            setattr(layer, w, nn.Parameter(codes, requires_grad=False))
            setattr(layer, f"{w}_scale", nn.Parameter(torch.ones(e, n, groups), requires_grad=False))
            setattr(layer, f"{w}_offset", nn.Parameter(torch.zeros(e, n, groups), requires_grad=False))
        self.create_biases(layer)
        if self.backend == "cpu":
            from stoker.layers.activation import ClampedSwiGLU

            self.activation = "silu" if layer.is_silu else "swigluoai" if isinstance(layer.act, ClampedSwiGLU) else None
            if self.activation is None or any(g % 2 for g in self.group.values()):
                self.backend = "dequant"  # moe.c's gates (SiLU, clamped SwiGLU) and even groups; else torch

    def checkpoint_params(self) -> tuple[str, ...]:
        return ("weight", "weight_scale", "weight_offset")

    def checkpoint_slice(
        self, layer: FusedMoE, shard: str, param: str, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        if param == "bias":
            return layer.bias_slice(shard, shape)
        if param == "weight":  # the unpacked codes (N, K): the float weight's part
            return layer.checkpoint_slice(shard, shape)
        if not layer.is_split:
            return None
        # scales and offsets (N, K / g): gate/up's rows, down's whole groups (create_weights checked)
        cut = slice(*layer.split.range(layer.checkpoint_intermediate_size))
        if shard != "w2":
            return (cut,)
        g = self.group["w2"]
        return (slice(None), slice(cut.start // g, cut.stop // g))

    # ---------------------------------------------------------------- loading
    def load(self, layer: FusedMoE, expert: int, shard: str, tensor: torch.Tensor, param: str = "weight") -> None:
        if param == "bias":
            return self.load_bias(layer, expert, shard, tensor)
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} does not exist: the config has num_experts {layer.num_experts}")
        i, h = layer.intermediate_size, layer.hidden_size
        rows = {"w1": slice(0, i), "w3": slice(i, 2 * i), "w2": slice(0, h)}[shard]
        w = "w2" if shard == "w2" else "w13"
        n, k = rows.stop - rows.start, layer.hidden_size if w == "w13" else i
        where = f"expert {expert} {shard} {param}"
        with torch.no_grad():
            if param == "weight":
                target = getattr(layer, w)[expert, rows]
                if self.bits[w] == 4:
                    if tensor.dtype != torch.uint8 or (tensor.numel() and int(tensor.max()) > 15):
                        raise ValueError(f"{where}: expected 4-bit codes (uint8 in [0, 15]), got {tensor.dtype}")
                    target.copy_(int4.pack(_shaped(tensor, (n, k), where)))
                else:
                    if tensor.dtype != torch.int8:
                        raise ValueError(f"{where}: expected int8 codes, got {tensor.dtype}")
                    target.copy_(_shaped(tensor, (n, k), where))
            elif param in ("weight_scale", "weight_offset"):
                target = getattr(layer, f"{w}_{param.removeprefix('weight_')}")[expert, rows]
                target.copy_(_shaped(tensor, (n, k // self.group[w]), where).float())
            else:
                raise ValueError(f"unexpected checkpoint tensor {where} for experts held per projection "
                                 f"({self.describe()})")

    # ---------------------------------------------------------------- layout and forward
    def process_after_loading(self, layer: FusedMoE) -> None:
        if self.backend == "cpu":
            from stoker.layers.moe_int4 import hold_coded_panels

            hold_coded_panels(layer)

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H) -> (T, H)
        if self.backend != "cpu":
            return super().apply(layer, x, topk_weights, topk_ids)
        from stoker.kernels.cpu import moe as cpu_moe

        b13, b2 = (layer.w13_bias, layer.w2_bias) if layer.has_bias else (None, None)
        alpha, limit = (layer.act.alpha, layer.act.limit) if self.activation == "swigluoai" else (0.0, 0.0)
        w13, w2 = ((getattr(layer, w), getattr(layer, f"{w}_scale"), getattr(layer, f"{w}_offset"), self.group[w],
                    self.bits[w]) for w in ("w13", "w2"))
        return cpu_moe.fused_moe_coded(x, w13, w2, topk_weights, topk_ids, b13, b2, self.activation or "silu", alpha,
                                       limit)

    def dequantized(self, layer: FusedMoE, w: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's w13 (2I, H) or w2 (H, I) as the float weight its codes stand for (the
        loading layout: the torch backend's, the cpu backend's before process_after_loading)."""
        codes = getattr(layer, w)[e]
        q = int4.unpack(codes) if self.bits[w] == 4 else codes
        scale, offset = getattr(layer, f"{w}_scale")[e], getattr(layer, f"{w}_offset")[e]
        return int4.dequantize(q, scale, offset, self.group[w], dtype)

    def expert_forward(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        w13, w2 = self.dequantized(layer, "w13", e, rows.dtype), self.dequantized(layer, "w2", e, rows.dtype)
        if layer.has_bias:
            return layer.act(rows @ w13.t() + layer.w13_bias[e]) @ w2.t() + layer.w2_bias[e]
        return layer.act(rows @ w13.t()) @ w2.t()


def _whole_groups(k: int, group: int, where: str) -> None:
    if group <= 0 or k % group:
        raise ValueError(f"{where}: {k} input columns are not whole groups of {group}")


def _shaped(t: torch.Tensor, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"shape mismatch for {where}: checkpoint {tuple(t.shape)}, expected {shape}")
    return t
