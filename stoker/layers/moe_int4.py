"""4-bit Mixture-of-Experts experts (W4A16): affine int4 groups, activations in the model dtype.

The dense int4 method's representation (quantization/int4.py: w = q * scale + offset per output
row and group of `group_k` columns), expert by expert:

    w13         (E, 2I, H / 2) uint8    each expert's [gate; up] codes, two a byte (int4.pack)
    w13_scale   (E, 2I, H / g) float32
    w13_offset  (E, 2I, H / g) float32  while loading a checkpoint with zero points: the zero
                                        point z, made -z * scale by process_after_loading
    w2          (E, H, I / 2)  uint8
    w2_scale    (E, H, I / g)  float32
    w2_offset   (E, H, I / g)  float32

gate and up keep their own scales and zero points (two shards of one expert, as a merged
gate/up projection's). 0.5 byte a weight plus 8 bytes a group: Qwen3-30B-A3B's experts
(~57 GB in bf16) take ~15 GB in groups of 128.

Sources (the dense method's formats, layers/int4_method.py, each expert's tensors by their
checkpoint names `experts.{e}.gate_proj.qweight`, ... as shard `(expert, "w1" | "w3" | "w2")`):
  online               `--quantization int4` on a float MoE: each float expert tensor quantized
                       as it is read (round-to-nearest, symmetric, groups of 128)
  compressed-tensors   pack-quantized W4A16 (llm-compressor): weight_packed (N, K / 8) int32,
                       weight_scale (N, G), weight_shape, weight_zero_point (N / 8, G) when asymmetric
  gptq / gptq_v2       qweight (K / 8, N), qzeros (G, N / 8) (zero - 1 for "gptq"), scales (G, N),
                       g_idx read and refused by name unless in plain group order (desc_act)
  awq                  GEMM packing: qweight (K, N / 8), qzeros (G, N / 8) in AWQ's nibble order
  gguf                 a GGUF file's Q4_0 / Q4_1 / Q4_K experts, decoded by models/gguf_loader.py
                       (quantization/gguf_blocks.py): weight (N, K) uint8 codes, weight_scale and
                       weight_offset (N, K / 32) float32, the offset itself (not a zero point)

Tensor parallelism cuts I: each rank reads (or, online, quantizes) its rows of gate and up and
its columns of down, so I / tp and the cut must be whole groups, and a pre-quantized cut whole
int32s of eight packed values (each refused by name otherwise, with --enable-expert-parallel as
the way out). Expert parallelism holds whole experts and needs nothing here.

Backends, chosen once at build (models/method_chooser.py):
  cpu      CPU float32 with the C kernels: the one-call MoE kernel (kernels/cpu/moe.c,
           `stoker_fused_moe_coded_f32`, 4-bit codes) on the codes, scales and offsets regrouped into the
           linear kernel's panels after loading (kernels/cpu/moe.pack_coded_experts: codes
           (E, P, K / 2, NR), scales and offsets (E, P, G, NR)): each GEMM task dequantizes its
           panel (q * s, rounded, + o, rounded: int4.dequantize's definition; a vector loop
           along NR) into a per-thread buffer and runs the linear kernel's task on it, so the
           result is the float experts' on the dequantized weights, bit for bit.
  dequant  anything else (CUDA included): each routed expert's w13 and w2 dequantized in torch
           into the model dtype for that call, then the float expert's GEMMs. Correct, not fast.
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.layers.int4_method import AWQ_NIBBLE_OF_COLUMN, unpack_int32_nibbles
from stoker.layers.moe import EXPERT_SHARDS, FusedMoE, MoEMethod
from stoker.layers.weight_method import expect_shape
from stoker.quantization import formats, int4
from stoker.quantization.config import WeightScheme

INT4_MOE_BACKENDS = ("cpu", "dequant")


class Int4MoEMethod(MoEMethod):
    kind = "int4"
    graph_capturable = False  # the per-expert loop reads token counts on the host, as the float one

    def __init__(self, scheme: WeightScheme, online: bool, backend: str = "dequant", name: str = "experts") -> None:
        if backend not in INT4_MOE_BACKENDS:
            raise ValueError(f"unknown int4 MoE backend {backend!r}; one of {INT4_MOE_BACKENDS}")
        if scheme.dtype != "int4":
            raise ValueError(f"Int4MoEMethod holds int4 experts, not {scheme.dtype}")
        self.scheme = scheme
        self.online = online
        self.backend = backend
        self.name = name
        self.layout = "" if online else scheme.int4_layout
        self.offset_is_zero_point = self.layout not in ("", "gguf")  # until process_after_loading
        self.group_k13 = 0  # columns of H per w13 group; set by create_weights
        self.group_k2 = 0  # columns of I per w2 group
        self.activation: str | None = None  # the C kernel's name for the layer's gate (create_weights)

    def describe(self) -> str:
        group = f"group {self.scheme.group_size}" if self.scheme.strategy == "group" else "per channel"
        return f"experts int4 {group}{'' if self.scheme.symmetric else ' asymmetric'} via {self.backend}"

    # ---------------------------------------------------------------- parameters
    def _group(self, in_features: int, what: str) -> int:
        g = self.scheme.group_size if self.scheme.strategy == "group" else in_features
        assert g is not None
        int4.num_groups(in_features, g, f"{self.name} {what}")
        return g

    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        self.group_k13 = self._group(h, f"gate/up (hidden_size {h})")
        if self.scheme.strategy == "group" and layer.is_split:
            start, stop = layer.split.range(layer.checkpoint_intermediate_size)
            g = self.scheme.group_size
            assert g is not None
            if start % g or (stop - start) % g:
                raise ValueError(
                    f"{self.name}: tensor parallelism gives this rank columns [{start}, {stop}) of the experts' "
                    f"intermediate_size {layer.checkpoint_intermediate_size}, which splits an int4 group of {g} of the "
                    "down projection; choose a tensor_parallel_size whose parts are whole groups, or "
                    "--enable-expert-parallel (whole experts per rank)")
        self.group_k2 = self._group(i, f"down (intermediate_size {i} on this rank)")
        if h % 2 or i % 2:
            raise ValueError(f"{self.name}: int4 weights pack two columns to a byte; H {h} and I {i} must be even")
        zero = float(int4.SYMMETRIC_ZERO) if self.offset_is_zero_point else 0.0
        for w, n, k, g in (("w13", 2 * i, h, self.group_k13), ("w2", h, i, self.group_k2)):
            setattr(layer, w, nn.Parameter(torch.zeros(e, n, k // 2, dtype=torch.uint8), requires_grad=False))
            setattr(layer, f"{w}_scale", nn.Parameter(torch.ones(e, n, k // g), requires_grad=False))
            setattr(layer, f"{w}_offset", nn.Parameter(torch.full((e, n, k // g), zero), requires_grad=False))
        self.create_biases(layer)
        if self.backend == "cpu":
            from stoker.layers.activation import ClampedSwiGLU

            self.activation = "silu" if layer.is_silu else "swigluoai" if isinstance(layer.act, ClampedSwiGLU) else None
            if self.activation is None or self.group_k13 % 2 or self.group_k2 % 2:
                self.backend = "dequant"  # moe.c's gates (SiLU, clamped SwiGLU) and byte-aligned groups; else torch

    def checkpoint_params(self) -> tuple[str, ...]:
        if self.online:
            return ("weight",)
        if self.layout == "gguf":
            return ("weight", "weight_scale", "weight_offset")
        if self.layout == "compressed-tensors":
            return ("weight_packed", "weight_scale", "weight_shape") + (() if self.scheme.symmetric else ("weight_zero_point",))
        return ("qweight", "qzeros", "scales")  # gptq, gptq_v2, awq; GPTQ's g_idx is read when present

    def checkpoint_slice(
        self, layer: FusedMoE, shard: str, param: str, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        if param == "bias":
            return layer.bias_slice(shard, shape)
        if param == "weight":  # a float tensor, or (gguf) the unpacked codes (N, K): the float weight's part
            return layer.checkpoint_slice(shard, shape)
        if not layer.is_split or param == "weight_shape":
            return None
        if self.layout == "gguf":  # scales and offsets (N, K / g): gate/up's rows, down's groups (whole: create_weights)
            cut = slice(*layer.split.range(layer.checkpoint_intermediate_size))
            return (cut,) if shard != "w2" else (slice(None), slice(cut.start // self.group_k2, cut.stop // self.group_k2))
        # this rank's [start, stop) of I: rows of gate and up, columns (K) of down, in whole groups
        # (create_weights checked) and whole int32s of eight packed values (checked here)
        cut = slice(*layer.split.range(layer.checkpoint_intermediate_size))
        i = layer.checkpoint_intermediate_size
        group = self.group_k2
        awq, ct, every = self.layout == "awq", self.layout == "compressed-tensors", slice(None)
        if shard != "w2":  # (I, H) cut by rows N
            rows8 = self._aligned(cut, 8, "int32s of eight packed rows", i)
            if ct:
                return (rows8,) if param == "weight_zero_point" else (cut,)
            if param == "g_idx":
                return None
            return (every, rows8) if param == "qzeros" or (awq and param == "qweight") else (every, cut)
        groups = slice(cut.start // group, cut.stop // group)
        if ct:
            return (every, self._aligned(cut, 8, "int32s of eight packed columns", i)) if param == "weight_packed" \
                else (every, groups)
        if param == "qweight":
            return (cut,) if awq else (self._aligned(cut, 8, "int32s of eight packed input rows", i),)
        return (cut,) if param == "g_idx" else (groups,)

    def _aligned(self, part: slice, unit: int, what: str, total: int) -> slice:
        if part.start % unit or (part.stop % unit and part.stop != total):
            raise ValueError(f"{self.name}: tensor parallelism cuts the experts' intermediate_size at [{part.start}, "
                             f"{part.stop}) of {total}, which splits {what}; choose a tensor_parallel_size whose parts "
                             "align with them, or --enable-expert-parallel (whole experts per rank)")
        return slice(part.start // unit, -(-part.stop // unit))

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
        codes, scale, offset = (getattr(layer, f"{w}{p}")[expert, rows] for p in ("", "_scale", "_offset"))
        n, k = rows.stop - rows.start, codes.shape[1] * 2
        group = self.group_k2 if shard == "w2" else self.group_k13
        where = f"expert {expert} {shard} {param}"
        awq = self.layout == "awq"
        with torch.no_grad():
            if param == "weight" and self.online:
                if tensor.dtype not in formats.FLOAT_CHECKPOINT_DTYPES:
                    raise ValueError(f"--quantization int4 quantizes a float checkpoint; {where} is {tensor.dtype}")
                expect_shape(tuple(tensor.shape), (n, k), f"expert {expert}", shard)
                q, s, o = int4.quantize(tensor, group, symmetric=True)
                codes.copy_(int4.pack(q))
                scale.copy_(s)
                offset.copy_(o)
            elif self.layout == "gguf" and param in ("weight", "weight_scale", "weight_offset"):
                if param == "weight":
                    if tensor.dtype != torch.uint8 or (tensor.numel() and int(tensor.max()) > 15):
                        raise ValueError(f"{where}: expected 4-bit codes (uint8 in [0, 15]), got {tensor.dtype}")
                    codes.copy_(int4.pack(_shaped(tensor, (n, k), where)))
                else:
                    (scale if param == "weight_scale" else offset).copy_(_shaped(tensor, (n, k // group), where).float())
            elif param == "weight_packed" and self.layout == "compressed-tensors":
                codes.copy_(int4.pack(_shaped(unpack_int32_nibbles(tensor, k, dim=1, where=where), (n, k), where)))
            elif param == "weight_scale" and self.layout == "compressed-tensors":
                scale.copy_(_shaped(tensor, (n, k // group), where).float())
            elif param == "weight_zero_point" and self.layout == "compressed-tensors" and not self.scheme.symmetric:
                offset.copy_(_shaped(unpack_int32_nibbles(tensor, n, dim=0, where=where), (n, k // group), where).float())
            elif param == "weight_shape" and self.layout == "compressed-tensors":
                whole = [h, layer.checkpoint_intermediate_size] if shard == "w2" else [layer.checkpoint_intermediate_size, h]
                if [int(v) for v in tensor.reshape(-1).tolist()] != whole:
                    raise ValueError(f"{where} says {tensor.tolist()}, the layer expects {whole}")
            elif param == "qweight" and self.layout in ("gptq", "gptq_v2", "awq"):
                # AWQ (K, N / 8), eight output columns per int32 in its order; GPTQ (K / 8, N), eight input rows
                q = unpack_int32_nibbles(tensor, n, dim=1, where=where, order=AWQ_NIBBLE_OF_COLUMN) if awq \
                    else unpack_int32_nibbles(tensor, k, dim=0, where=where)
                codes.copy_(int4.pack(_shaped(q, (k, n), where).t()))
            elif param == "qzeros" and self.layout in ("gptq", "gptq_v2", "awq"):
                z = unpack_int32_nibbles(tensor, n, dim=1, where=where, order=AWQ_NIBBLE_OF_COLUMN if awq else None)
                # AutoGPTQ's format stores zero - 1 ("gptq"; "gptq_v2" and AWQ store the zero itself)
                offset.copy_(_shaped(z, (k // group, n), where).t().float() + (1.0 if self.layout == "gptq" else 0.0))
            elif param == "scales" and self.layout in ("gptq", "gptq_v2", "awq"):
                scale.copy_(_shaped(tensor, (k // group, n), where).t().float())
            elif param == "g_idx" and self.layout in ("gptq", "gptq_v2"):
                first = layer.split.range(layer.checkpoint_intermediate_size)[0] if shard == "w2" else 0  # this rank's K
                plain = torch.arange(first, first + k) // group
                if tuple(tensor.shape) != (k,) or not torch.equal(tensor.to(torch.int64), plain):
                    raise ValueError(f"{where} is not in plain group order (a desc_act / act-order checkpoint whose "
                                     "columns are permuted); Stoker's int4 experts do not permute columns: re-quantize "
                                     "with desc_act false")
            else:
                raise ValueError(f"unexpected checkpoint tensor {where} for int4 experts ({self.describe()})")

    # ---------------------------------------------------------------- layout and forward
    def process_after_loading(self, layer: FusedMoE) -> None:
        if self.offset_is_zero_point:  # w = (q - z) * s = q * s + (-z * s)
            for w in ("w13", "w2"):
                offset, scale = getattr(layer, f"{w}_offset"), getattr(layer, f"{w}_scale")
                offset.data = (-offset.data * scale.data).contiguous()
            self.offset_is_zero_point = False
        if self.backend == "cpu":
            hold_coded_panels(layer)

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H) -> (T, H)
        if self.backend != "cpu":
            return super().apply(layer, x, topk_weights, topk_ids)
        from stoker.kernels.cpu import moe as cpu_moe

        b13, b2 = (layer.w13_bias, layer.w2_bias) if layer.has_bias else (None, None)
        alpha, limit = (layer.act.alpha, layer.act.limit) if self.activation == "swigluoai" else (0.0, 0.0)
        return cpu_moe.fused_moe_int4(x, (layer.w13, layer.w13_scale, layer.w13_offset, self.group_k13),
                                      (layer.w2, layer.w2_scale, layer.w2_offset, self.group_k2), topk_weights, topk_ids,
                                      b13, b2, self.activation or "silu", alpha, limit)

    def dequantized(self, layer: FusedMoE, w: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's w13 (2I, H) or w2 (H, I) as the float weight its codes stand for (the
        loading layout: the torch backend's, the cpu backend's before process_after_loading)."""
        group = self.group_k13 if w == "w13" else self.group_k2
        return int4.dequantize(int4.unpack(getattr(layer, w)[e]), getattr(layer, f"{w}_scale")[e],
                               getattr(layer, f"{w}_offset")[e], group, dtype)

    def expert_forward(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        w13, w2 = self.dequantized(layer, "w13", e, rows.dtype), self.dequantized(layer, "w2", e, rows.dtype)
        if layer.has_bias:
            return layer.act(rows @ w13.t() + layer.w13_bias[e]) @ w2.t() + layer.w2_bias[e]
        return layer.act(rows @ w13.t()) @ w2.t()


def _shaped(t: torch.Tensor, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"shape mismatch for {where}: checkpoint {tuple(t.shape)}, expected {shape}")
    return t


def hold_coded_panels(layer: FusedMoE) -> None:
    """A layer's coded experts (w13 / w2 codes, scales and offsets, 4- or 8-bit) in moe.c's
    panels: codes (E, P, K / 2 or K, NR), scales and offsets (E, P, G, NR); biases (E, P * NR),
    padded to the panels, as the kernel's GEMM tasks read them. For the int4 and the
    per-projection (moe_mixed.py) methods' `cpu` backend."""
    from stoker.kernels.cpu import moe as cpu_moe

    for w in ("w13", "w2"):
        panels = cpu_moe.pack_coded_experts(*(getattr(layer, f"{w}{p}").data for p in ("", "_scale", "_offset")))
        for p, t in zip(("", "_scale", "_offset"), panels):
            setattr(layer, f"{w}{p}", nn.Parameter(t, requires_grad=False))
    if layer.has_bias:
        layer.w13_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w13_bias.data), requires_grad=False)
        layer.w2_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w2_bias.data), requires_grad=False)
