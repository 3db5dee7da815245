"""The 4-bit weight method (W4A16): affine int4 groups, activations in the model dtype.

Representation (quantization/int4.py): w = q * scale + offset per output row and group of
`group_k` columns. While loading, the parameters are

    weight         (N, K / 2) uint8   two codes per byte, even k in the low nibble (int4.pack)
    weight_scale   (N, G) float32
    weight_offset  (N, G) float32     (a checkpoint with zero points holds them here until
                                       process_after_loading turns them into -z * scale)

Backends, chosen once at build (models/method_chooser.py):
  cpu_q4   CPU float32 with the C kernels: nibble panels (kernels/cpu/linear_q4.h), codes
           converted in registers, scales and offsets applied once per group; scales held in
           float16 where exact, offsets dropped where zero (symmetric): 4.5 bits a weight for
           GGUF Q4_0 and symmetric checkpoints with 16-bit scales, as Q4_0 itself.
           With `activations="int8"` (--activation-dtype int8, W4A8) the same panels go
           through linear_q4_a8.h instead: x quantized to int8 per block of 32 (llama.cpp's
           Q8_0), integer dot products, one float multiply per block (groups a multiple of 32).
           A GGUF Q4_K weight (scales d sc and offsets -dmin m that factor exactly into 6-bit
           integers per 32 and a float pair per 256: linear_q4.factor_q4_k) is held in Q4_K's
           own bytes for W4A8 (held "q4k", linear_q4k_a8.h: 4.6 bits a weight against the
           float32 scales and offsets' 6): weight_scale then holds the (2, G, P NR) uint8
           sub-scales [sc; m], weight_offset the (2, K / 256, P NR) float32 [d; dmin].
  triton_w4a16  CUDA with Triton (group sizes that are multiples of 32, or per channel):
           the packed codes as loaded, scales in float16 where exact, offsets o' = o + 8 s
           dropped where zero, as cpu_q4; one of two paths by the rows M of the call
           (`w4a16_route`), chosen on the host from the shape alone (CUDA-graph safe):
             M <= 4 (decode)   the GEMV (kernels/quant_gemv.py gemv_w4): weights read once,
                               contiguously, no tl.dot; K a multiple of 32.
             otherwise         dequantize the layer to x's dtype (quant_gemv.dequant_w4, the
                               twin's weight exactly) and F.linear (cuBLAS); the dequantized
                               weight is a transient (N, K) tensor of x's dtype, one layer's
                               at a time.
           Measured on the H200 (benchmarks/w4a16_gpu.py, Llama-3-8B projections, group 128;
           docs/benchmarks.md, "GPU: one NVIDIA H200"): at M = 1 the GEMV took 0.030 / 0.079 /
           0.043 ms (qkv / gate_up / down) against dequantize + F.linear's 0.043 / 0.170 /
           0.099; at M = 8 the order reversed (0.049 / 0.182 / 0.124 against 0.042 / 0.171 /
           0.088), so 4 sits between the two measured points. The W4A16 tile GEMM
           (kernels/w4a16_linear.py) lost to dequantize + F.linear at every M measured (0.31
           against 0.043 ms on qkv at M = 64, 6.9 against 0.16 at 2048) and is no longer
           dispatched; it stays as a benchmark peer. torch's `_weight_int4pack_mm` beat both
           paths at M <= 8 (0.013 / 0.038 / 0.022 ms at M = 1) but needs its own weight layout
           beside the codes the dequantizing path reads: the tinygemm form below holds that
           layout instead of the codes.
           The tinygemm form (kernels/tinygemm_int4.py), taken per layer at load for bfloat16
           models where tinygemm takes the shape (N % 8, K % 128, groups of 32-256): the layer
           held in torch's tinygemm layout only, with bfloat16 scales and zeros (G, N, 2);
           M <= TINYGEMM_ROWS (32) through `torch._weight_int4pack_mm`, more rows dequantized
           from the same bytes by tinygemm_int4.dequant_tinygemm and F.linear.
  dequant  anything else: the twin, which dequantizes one layer per call
           (reference.int4_linear).

Sources: online (`--quantization int4`: each float checkpoint tensor is quantized as it is
read, round-to-nearest, symmetric, this rank's part only), compressed-tensors pack-quantized
W4A16 (`weight_packed` eight codes to an int32, `weight_scale`, `weight_shape`, and packed
`weight_zero_point` when asymmetric), GPTQ and AWQ (`qweight`, `qzeros`, `scales`, GPTQ's
`g_idx`; quantization/config._gptq_awq gives the layouts), and loaders that decode a format to
the affine form themselves (GGUF): `load_affine`.

Tensor parallelism cuts rows freely and columns only at group boundaries (and packed int32
values at multiples of eight): a cut that splits a group is refused, naming the layer and sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from stoker.kernels import reference
from stoker.layers.linear import Linear
from stoker.layers.weight_method import FusedGateUpMixin, LinearMethod, copy_rows, expect_shape
from stoker.quantization import formats, int4
from stoker.quantization.config import WeightScheme

if TYPE_CHECKING:
    from stoker.kernels.cpu.decoder_layer import LinearSlots

BACKENDS = ("cpu_q4", "triton_w4a16", "dequant")
PACK_FACTOR = 8  # 4-bit values per int32 (compressed-tensors, GPTQ, AWQ)
# AutoAWQ's GEMM packing: nibble i of an int32 holds column AWQ_ORDER[i] of its eight, so
# column j is nibble AWQ_NIBBLE_OF_COLUMN[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
GEMV_ROWS = 4  # triton_w4a16: the GEMV up to this many rows, dequantize + F.linear above (see the docstring)


def w4a16_route(num_rows: int, in_features: int, group_k: int) -> str:
    """The triton_w4a16 backend's path for a call of `num_rows` rows: "gemv" (decode) or
    "dequant_linear"."""
    from stoker.kernels.quant_gemv import supports

    return "gemv" if num_rows <= GEMV_ROWS and supports(num_rows, in_features, group_k, 4) else "dequant_linear"


class Int4LinearMethod(FusedGateUpMixin, LinearMethod):
    kind = "int4"

    def __init__(self, scheme: WeightScheme, online: bool, backend: str, fuse_silu_and_mul: bool = False,
                 name: str = "projection", activations: str = "auto", dtype: torch.dtype | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown int4 backend {backend!r}")
        if activations not in ("auto", "int8") or (activations == "int8" and backend != "cpu_q4"):
            raise ValueError(f"{name}: int4 activations {activations!r} on backend {backend!r}; int8 (W4A8) needs cpu_q4")
        self.activations = activations
        if scheme.dtype != "int4":
            raise ValueError(f"Int4LinearMethod holds int4 weights, not {scheme.dtype}")
        self.scheme = scheme
        self.online = online
        self.backend = backend
        self.name = name
        self.fuse_silu_and_mul = fuse_silu_and_mul and backend == "cpu_q4"
        # A checkpoint with zero points (or symmetric codes, zero 8) fills weight_offset with
        # the zero point; process_after_loading makes it -z * scale.
        self.layout = scheme.int4_layout
        self.offset_is_zero_point = self.layout != ""
        self.group_k = 0  # set by create_weights
        self.kernel = None
        self.dtype = dtype  # the model's (activations'): the tinygemm form is held for bfloat16 only
        # or "tinygemm" (triton_w4a16), or "q4k" (cpu_q4 W4A8, a Q4_K weight): chosen per layer in process_after_loading
        self.held = "codes"
        self.tinygemm = None
        self.tinygemm_rows = 0
        self._forward = self._not_loaded

    def describe(self) -> str:
        group = f"group {self.scheme.group_size}" if self.scheme.strategy == "group" else "per channel"
        w4a8 = " W4A8 (int8 activations)" if self.activations == "int8" else ""
        held = {"tinygemm": " (tinygemm layout)", "q4k": " held as Q4_K (6-bit sub-scales)"}.get(self.held, "")
        return f"int4 {group}{'' if self.scheme.symmetric else ' asymmetric'}{w4a8} via {self.backend}{held}"

    def _not_loaded(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an int4 projection runs only after models.loader.load_weights")

    # ---------------------------------------------------------------- parameters
    def create_weights(self, layer: Linear) -> None:
        k = layer.in_features
        self.group_k = self.scheme.group_size if self.scheme.strategy == "group" else k
        assert self.group_k is not None
        cols = layer.checkpoint_cols()
        if k % self.group_k or cols.start % self.group_k:
            cut = f" (tensor parallelism gives this rank columns [{cols.start}, {cols.stop}) of {layer.checkpoint_in_features})" if layer.is_split else ""
            raise ValueError(f"{self.name}: {k} input columns{cut} are not whole int4 groups of {self.group_k}; "
                             "choose a group size (or tensor_parallel_size) whose groups are not split")
        if k % 2:
            raise ValueError(f"{self.name}: int4 weights pack two columns to a byte; {k} input columns is odd")
        if self.activations == "int8" and self.group_k % 32:
            raise ValueError(f"{self.name}: --activation-dtype int8 quantizes activations in blocks of 32 columns, which "
                             f"int4 groups of {self.group_k} do not hold whole; use --activation-dtype auto")
        groups = k // self.group_k
        n = layer.out_features
        layer.weight = nn.Parameter(torch.zeros(n, k // 2, dtype=torch.uint8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.ones(n, groups, dtype=torch.float32), requires_grad=False)
        zero = float(int4.SYMMETRIC_ZERO) if self.offset_is_zero_point else 0.0
        layer.weight_offset = nn.Parameter(torch.full((n, groups), zero, dtype=torch.float32), requires_grad=False)

    def checkpoint_params(self, layer: Linear) -> tuple[str, ...]:
        if self.online:
            return ("weight",)
        if self.layout == "compressed-tensors":
            zero = () if self.scheme.symmetric else ("weight_zero_point",)
            return ("weight_packed", "weight_scale", "weight_shape", *zero)
        if self.layout:  # gptq, gptq_v2, awq (GPTQ's g_idx is read when present)
            return ("qweight", "qzeros", "scales")
        return ()  # a loader hands the affine form itself (load_affine)

    def checkpoint_slice(
        self, layer: Linear, param_name: str, shard: str | None, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        """A rank's part: weight_packed by rows and int32s of eight columns, scales by rows and
        groups, zero points by int32s of eight rows and groups; weight_shape whole."""
        if not layer.is_split or param_name in ("weight", "bias"):
            return super().checkpoint_slice(layer, param_name, shard, shape)
        rows, cols = layer.checkpoint_rows(shard), layer.checkpoint_cols()
        num_rows, k = layer.checkpoint_shape(shard)
        group = self.scheme.group_size if self.scheme.strategy == "group" else k
        assert group is not None
        if param_name == "weight_packed":
            expect_shape(shape, (num_rows, -(-k // PACK_FACTOR)), param_name, shard)
            return rows, self._aligned(cols, PACK_FACTOR, "int32s of eight packed columns", k)
        if param_name == "weight_scale":
            expect_shape(shape, (num_rows, k // group), param_name, shard)
            return rows, self._aligned(cols, group, f"int4 groups of {group} columns", k)
        if param_name == "weight_zero_point":
            expect_shape(shape, (-(-num_rows // PACK_FACTOR), k // group), param_name, shard)
            return self._aligned(rows, PACK_FACTOR, "int32s of eight packed zero-point rows", num_rows), \
                self._aligned(cols, group, f"int4 groups of {group} columns", k)
        # GPTQ / AWQ store W^T: rows of K, columns of N
        groups = self._aligned(cols, group, f"int4 groups of {group} columns", k)
        if param_name == "qweight" and self.layout.startswith("gptq"):
            expect_shape(shape, (k // PACK_FACTOR, num_rows), param_name, shard)
            return self._aligned(cols, PACK_FACTOR, "int32s of eight packed input columns", k), rows
        if param_name == "qweight":
            expect_shape(shape, (k, num_rows // PACK_FACTOR), param_name, shard)
            return cols, self._aligned(rows, PACK_FACTOR, "int32s of eight packed output rows", num_rows)
        if param_name == "qzeros":
            expect_shape(shape, (k // group, num_rows // PACK_FACTOR), param_name, shard)
            return groups, self._aligned(rows, PACK_FACTOR, "int32s of eight packed output rows", num_rows)
        if param_name == "scales":
            expect_shape(shape, (k // group, num_rows), param_name, shard)
            return groups, rows
        if param_name == "g_idx":
            return (cols,)
        return None

    def _aligned(self, part: slice, unit: int, what: str, total: int) -> slice:
        if part.start % unit or (part.stop % unit and part.stop != total):
            raise ValueError(f"{self.name}: tensor parallelism cuts it at [{part.start}, {part.stop}) of {total}, which "
                             f"splits {what}; choose a tensor_parallel_size whose parts align with them")
        return slice(part.start // unit, -(-part.stop // unit))

    # ---------------------------------------------------------------- loading
    def load(self, layer: Linear, param_name: str, shard: str | None, tensor: torch.Tensor) -> None:
        rows = layer.shard_rows(shard)
        num_rows, k = rows.stop - rows.start, layer.in_features
        where = f"{self.name}.{param_name}" + (f" (shard {shard!r})" if shard else "")
        if param_name == "bias":
            copy_rows(layer, layer.bias, shard, tensor, "bias")
        elif param_name == "weight" and self.online:
            if tensor.dtype not in formats.FLOAT_CHECKPOINT_DTYPES:
                raise ValueError(f"--quantization int4 quantizes a float checkpoint; {where} is {tensor.dtype}")
            if tuple(tensor.shape) != (num_rows, k):
                raise ValueError(f"shape mismatch for {where}: checkpoint {tuple(tensor.shape)}, expected {(num_rows, k)}")
            q, scale, offset = int4.quantize(tensor, self.group_k, symmetric=True)
            self._store(layer, rows, q, scale, offset)
        elif param_name == "weight_packed" and self.scheme.packed:
            codes = unpack_int32_nibbles(tensor, k, dim=1, where=where)
            copy_rows(layer, layer.weight, shard, int4.pack(codes), where)
        elif param_name == "weight_scale" and self.scheme.packed:
            expect_shape(tuple(tensor.shape), (num_rows, k // self.group_k), where, None)
            with torch.no_grad():
                layer.weight_scale[rows].copy_(tensor.float())
        elif param_name == "weight_zero_point" and self.scheme.packed and not self.scheme.symmetric:
            zero = unpack_int32_nibbles(tensor, num_rows, dim=0, where=where)  # (rows, G) codes
            expect_shape(tuple(zero.shape), (num_rows, k // self.group_k), where, None)
            with torch.no_grad():
                layer.weight_offset[rows].copy_(zero.float())
        elif self.layout in ("gptq", "gptq_v2", "awq") and param_name in ("qweight", "qzeros", "scales", "g_idx"):
            self._load_gptq_awq(layer, param_name, shard, tensor, where)
        elif param_name == "weight_shape" and self.scheme.packed:
            whole = list(layer.checkpoint_shape(shard))
            if [int(v) for v in tensor.reshape(-1).tolist()] != whole:
                raise ValueError(f"{where} says {tensor.tolist()}, the layer expects {whole}")
        else:
            raise ValueError(f"unexpected checkpoint tensor {where} for an int4 projection ({self.describe()})")

    def _load_gptq_awq(self, layer: Linear, param_name: str, shard: str | None, tensor: torch.Tensor, where: str) -> None:
        """GPTQ / AWQ tensors (transposed: K or groups first, N last) into the (N, ...) parameters;
        zero points go to weight_offset until process_after_loading."""
        rows = layer.shard_rows(shard)
        num_rows, k = rows.stop - rows.start, layer.in_features
        awq = self.layout == "awq"
        if param_name == "qweight":
            if awq:  # (K, N / 8), eight output columns per int32 in AWQ's order
                codes = unpack_int32_nibbles(tensor, num_rows, dim=1, where=where, order=AWQ_NIBBLE_OF_COLUMN)
            else:  # (K / 8, N), eight input rows per int32 in order
                codes = unpack_int32_nibbles(tensor, k, dim=0, where=where)
            expect_shape(tuple(codes.shape), (k, num_rows), where, None)
            copy_rows(layer, layer.weight, shard, int4.pack(codes.t()), where)
        elif param_name == "qzeros":
            zero = unpack_int32_nibbles(tensor, num_rows, dim=1, where=where, order=AWQ_NIBBLE_OF_COLUMN if awq else None)
            expect_shape(tuple(zero.shape), (k // self.group_k, num_rows), where, None)
            # AutoGPTQ's format stores zero - 1 ("gptq"; "gptq_v2" and AWQ store the zero itself)
            with torch.no_grad():
                layer.weight_offset[rows].copy_(zero.t().float() + (1.0 if self.layout == "gptq" else 0.0))
        elif param_name == "scales":
            expect_shape(tuple(tensor.shape), (k // self.group_k, num_rows), where, None)
            with torch.no_grad():
                layer.weight_scale[rows].copy_(tensor.t().float())
        else:  # g_idx: the group of each input column; act-order checkpoints permute it
            cols = layer.checkpoint_cols()
            plain = torch.arange(cols.start, cols.stop) // self.group_k
            if tuple(tensor.shape) != tuple(plain.shape) or not torch.equal(tensor.to(torch.int64), plain):
                raise ValueError(f"{where} is not in plain group order (a desc_act / act-order checkpoint whose columns are "
                                 "permuted); Stoker's int4 kernels do not permute columns: re-quantize with desc_act false")

    def load_affine(self, layer: Linear, shard: str | None, weight: int4.AffineInt4) -> None:
        """One checkpoint tensor already in the affine form (quantization/int4.py, the GGUF
        loader's entry point): the whole tensor of `shard`; this rank's rows and columns are
        cut here, at group boundaries."""
        where = f"{self.name}" + (f" (shard {shard!r})" if shard else "")
        if self.online or self.scheme.packed:
            raise ValueError(f"{where}: this int4 method reads {self.checkpoint_params(layer)}, not decoded affine weights")
        weight.check(where)
        if weight.group_size != self.group_k:
            raise ValueError(f"{where}: the tensor has int4 groups of {weight.group_size}, the layer was built for {self.group_k}")
        expect_shape(tuple(weight.q.shape), layer.checkpoint_shape(shard), where, None)
        rows, cols = layer.checkpoint_rows(shard), layer.checkpoint_cols()
        groups = self._aligned(cols, self.group_k, f"int4 groups of {self.group_k} columns", weight.q.shape[1])
        self._store(layer, layer.shard_rows(shard), weight.q[rows, cols], weight.scale[rows, groups], weight.offset[rows, groups])

    def _store(self, layer: Linear, rows: slice, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        with torch.no_grad():
            layer.weight[rows].copy_(int4.pack(q))
            layer.weight_scale[rows].copy_(scale.float())
            layer.weight_offset[rows].copy_(offset.float())

    # ---------------------------------------------------------------- layout for the backend
    def process_after_loading(self, layer: Linear) -> None:
        if self.offset_is_zero_point:  # w = (q - z) * s = q * s + (-z * s)
            layer.weight_offset.data = (-layer.weight_offset.data * layer.weight_scale.data).contiguous()
            self.offset_is_zero_point = False
        if self.backend == "cpu_q4" and self._hold_q4k(layer):
            return
        if self.backend == "cpu_q4":
            from stoker.kernels.cpu import linear as cpu_linear
            from stoker.kernels.cpu import linear_q4

            gate_up = self.fuse_silu_and_mul
            codes = int4.unpack(layer.weight.data)
            scales, offsets = linear_q4.pack_q4_scales(layer.weight_scale.data, layer.weight_offset.data, gate_up)
            layer.weight = nn.Parameter(linear_q4.pack_q4_weight(codes, gate_up), requires_grad=False)
            layer.weight_scale = nn.Parameter(scales, requires_grad=False)
            # None when every o + 8 s is 0 (symmetric): not held, not read
            layer.weight_offset = None if offsets is None else nn.Parameter(offsets, requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(cpu_linear.pack_linear_weight(layer.bias.data.float(), gate_up=gate_up), requires_grad=False)
            self.kernel = linear_q4.linear_q4_a8 if self.activations == "int8" else linear_q4.linear_q4
            # checked once here; a decode step then pays for x's checks alone (BoundQ4Linear)
            self.bound = linear_q4.BoundQ4Linear(self.kernel, layer.weight, layer.weight_scale, layer.weight_offset,
                                                 self.group_k, layer.out_features, layer.bias, self.fuse_silu_and_mul)
            self._forward = self._cpu_q4
        elif self.backend == "triton_w4a16":
            from stoker.kernels import tinygemm_int4
            from stoker.kernels.quant_gemv import dequant_w4, gemv_w4
            from stoker.kernels.w4a16_linear import hold_scales

            scales, offsets = hold_scales(layer.weight_scale.data, layer.weight_offset.data)
            if (self.dtype == torch.bfloat16 and layer.weight.is_cuda
                    and tinygemm_int4.supported(layer.out_features, layer.in_features, self.group_k)):
                w = tinygemm_int4.hold(layer.weight.data, scales, offsets, self.group_k)
                # the layout's words and the (G, N, 2) bfloat16 scales and zeros are all it holds
                layer.weight = nn.Parameter(w.words, requires_grad=False)
                layer.weight_scale = nn.Parameter(w.scales_and_zeros, requires_grad=False)
                layer.weight_offset = None
                self.tinygemm, self.held, self.tinygemm_rows = w, "tinygemm", tinygemm_int4.TINYGEMM_ROWS
                self.gemv, self.dequantize = tinygemm_int4.tinygemm_mm, tinygemm_int4.dequant_tinygemm
                self._forward = self._tinygemm
                return
            # the codes stay as loaded ((N, K / 2), even k in the low nibble: the kernel's layout)
            layer.weight_scale = nn.Parameter(scales, requires_grad=False)
            layer.weight_offset = None if offsets is None else nn.Parameter(offsets, requires_grad=False)
            self.gemv = gemv_w4
            self.dequantize = dequant_w4
            self._forward = self._triton
        else:
            self.kernel = reference.int4_linear
            self._forward = self._dequant

    # ---------------------------------------------------------------- forward
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self._forward(layer, x)

    def _hold_q4k(self, layer: Linear) -> bool:
        """W4A8 on a Q4_K weight: its codes in the usual 4-bit panels, its scales and offsets as
        Q4_K's 6-bit sub-scales and float pairs per 256 (linear_q4k_a8.h); False (the float32
        scales and offsets follow) for any other weight."""
        from stoker.kernels.cpu import linear as cpu_linear
        from stoker.kernels.cpu import linear_q4

        if self.activations != "int8" or self.group_k != linear_q4.Q8_BLOCK or layer.in_features % linear_q4.Q4K_SUPER:
            return False
        factors = linear_q4.factor_q4_k(layer.weight_scale.data, layer.weight_offset.data)
        if factors is None:
            return False
        gate_up = self.fuse_silu_and_mul
        sub, sup = linear_q4.pack_q4k_scales(*factors, gate_up)
        layer.weight = nn.Parameter(linear_q4.pack_q4_weight(int4.unpack(layer.weight.data), gate_up), requires_grad=False)
        layer.weight_scale = nn.Parameter(sub, requires_grad=False)
        layer.weight_offset = nn.Parameter(sup, requires_grad=False)
        if layer.bias is not None:
            layer.bias = nn.Parameter(cpu_linear.pack_linear_weight(layer.bias.data.float(), gate_up=gate_up), requires_grad=False)
        self.held = "q4k"
        self.kernel = linear_q4.linear_q4k_a8
        self._forward = self._cpu_q4k
        return True

    def _cpu_q4k(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, layer.weight, layer.weight_scale, layer.weight_offset, self.group_k, layer.out_features,
                           layer.bias, self.fuse_silu_and_mul)

    def _cpu_q4(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bound = self.bound
        if bound.entry is self.kernel:  # not when a test swapped the kernel for its twin
            return bound(x)
        return self.kernel(x, layer.weight, layer.weight_scale, layer.weight_offset, self.group_k, layer.out_features,
                           layer.bias, self.fuse_silu_and_mul)

    def apply_pre_activation(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """A fused [gate; up] layer's output before SiLU-and-mul, in panel order (LoRA adds to it)."""
        return self.kernel(x, layer.weight, layer.weight_scale, layer.weight_offset, self.group_k, layer.out_features,
                           layer.bias, False)

    def c_linear_slots(self, layer: Linear) -> LinearSlots | None:
        from stoker.kernels.cpu import decoder_layer

        from stoker.kernels.cpu import linear_q4

        if self.backend == "cpu_q4" and self.held == "q4k" and self.kernel is linear_q4.linear_q4k_a8:
            return decoder_layer.linear_slots_q4k_a8(layer.weight, layer.weight_scale, layer.weight_offset, layer.bias,
                                                     layer.out_features, self.fuse_silu_and_mul)
        if self.backend != "cpu_q4" or self.held == "q4k" or self.bound.entry is not self.kernel:
            return None
        return decoder_layer.linear_slots_q4(self.activations == "int8", layer.weight, layer.weight_scale, layer.weight_offset,
                                             self.group_k, layer.bias, layer.out_features, self.fuse_silu_and_mul)

    def _triton(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        route = w4a16_route(x.numel() // x.shape[-1], x.shape[-1], self.group_k)
        if route == "gemv":
            return self.gemv(x, layer.weight, layer.weight_scale, layer.weight_offset, self.group_k, layer.bias)
        w = self.dequantize(layer.weight, layer.weight_scale, layer.weight_offset, self.group_k, x.dtype)
        return torch.nn.functional.linear(x, w, None if layer.bias is None else layer.bias.to(x.dtype))

    def _tinygemm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= self.tinygemm_rows:
            out = self.gemv(x2.contiguous(), self.tinygemm)
            if layer.bias is not None:
                out = out + layer.bias.to(out.dtype)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        w = self.dequantize(self.tinygemm, x.dtype)
        return torch.nn.functional.linear(x, w, None if layer.bias is None else layer.bias.to(x.dtype))

    def _dequant(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, int4.unpack(layer.weight), layer.weight_scale, layer.weight_offset, self.group_k, layer.bias)


def unpack_int32_nibbles(packed: torch.Tensor, count: int, dim: int, where: str,
                         order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32s of eight unsigned 4-bit codes along `dim` (value i of each int32 in bits
    4i..4i+3; compressed-tensors stores the signed value + 8), zero-padded to a multiple of
    eight -> uint8 codes in [0, 15] with `count` entries along `dim`. `order`: entry j of each
    eight is nibble order[j] (AWQ's packing), else nibble j."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"{where} must be a 2-D int32 tensor, got {tuple(packed.shape)} {packed.dtype}")
    if packed.shape[dim] * PACK_FACTOR < count:
        raise ValueError(f"{where} holds {packed.shape[dim] * PACK_FACTOR} values along dim {dim}, the layer needs {count}")
    shifts = torch.tensor([4 * i for i in (order or range(PACK_FACTOR))], dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0x0F  # (..., 8) along a new last dim
    if dim == 1:
        codes = codes.reshape(packed.shape[0], -1)[:, :count]
    else:  # (R8, G, 8) -> (R8, 8, G) -> (R8 * 8, G)
        codes = codes.permute(0, 2, 1).reshape(-1, packed.shape[1])[:count]
    return codes.to(torch.uint8).contiguous()


def pack_int32_nibbles(codes: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack_int32_nibbles` (used to write test checkpoints as llm-compressor,
    AutoGPTQ and AutoAWQ do)."""
    c = codes.to(torch.int64)
    if dim == 0:
        return pack_int32_nibbles(c.t(), 1, order).t().contiguous()
    n, k = c.shape
    padded = torch.zeros(n, -(-k // PACK_FACTOR) * PACK_FACTOR, dtype=torch.int64)
    padded[:, :k] = c
    groups = padded.view(n, -1, PACK_FACTOR)
    nibble = order or tuple(range(PACK_FACTOR))
    value = sum(groups[..., j] << (4 * nibble[j]) for j in range(PACK_FACTOR))
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)
