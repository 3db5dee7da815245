"""The quantized linear method: FP8 or INT8 weights, per-row and per-group scales.

One method class, its representation fixed by a `WeightScheme` and its backend chosen once
at build (`models/method_chooser.py`):

  cpu_q8     CPU float32 activations with the C kernels: one-byte panels (linear.c,
             stoker_linear_q8), dequantized in registers: a quarter of float32's bytes.
             With `activations="int8"` (--activation-dtype int8) a weight that is GGUF's Q6_K
             (int8 codes in [-32, 31], groups of 16 whose scales factor exactly into an int8
             sub-scale times a super-scale per 256: kernels/cpu/linear_q6.py) is held in 6-bit
             panels instead and runs W6A8 (linear_q6_a8.h): Q6_K's 6.6 bits a weight where the
             one-byte panels hold 10. Any other int8 weight keeps the one-byte panels, weight-only.
  int8pack   CPU without the C kernels, INT8 with one scale per row: torch's
             `_weight_int8pack_mm` (measured far slower than cpu_q8: docs/benchmarks.md).
  scaled_mm  CUDA with FP8 matrix units (compute capability 8.9+), FP8 with per-row
             scales: W8A8, activations quantized per token (or with the checkpoint's static
             input_scale), `torch._scaled_mm`, from 9 rows up. At decode (M <= 8 rows, K a
             multiple of 32) the FP8 weights are read by the weight-only GEMV instead
             (kernels/quant_gemv.py gemv_w8) with the activations in the model dtype:
             weight-only numerics at decode, W8A8 at prefill. Measured on the H200
             (docs/benchmarks.md, "GPU: one NVIDIA H200"), Llama-3-8B-shaped FP8 decode at
             batch 1: 6.49 ms GPU forward with _scaled_mm at every M, 4.91 with the GEMV,
             bf16 4.57: the GEMV streams FP8 at 0.9-1.6 TB/s, not yet at the copy rate.
  triton_w8  other CUDA cases (INT8, FP8 blocks, GPUs without FP8 units): weight-only; the
             GEMV (kernels/quant_gemv.py gemv_w8) for single rows (K a multiple of 32), the
             Triton GEMM dequantizing in the tile (kernels/w8_linear.py) above. Measured on the
             H200 (benchmarks/w4a16_gpu.py, int8 per channel, qkv + gate_up + down): at M = 1
             the GEMV 0.150 ms against the tile kernel's 0.214; at M = 8 the tile kernel
             0.214 against the GEMV's 0.373.
  dequant    anything else: the twin, which dequantizes one layer per call (never the whole
             model at once).

Loading: online (`--quantization`), each float checkpoint tensor is quantized as it is read,
per output row (a merged layer's shards are rows, so shard by shard is the same as the
whole), so no full-precision copy of the model exists at any time. Pre-quantized, every
strategy's scales are brought to (rows, groups) (`formats.scale_rows`), shard by shard, so
merged q/k/v and gate/up keep their own scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from stoker.kernels import reference
from stoker.layers.linear import Linear
from stoker.layers.weight_method import FusedGateUpMixin, LinearMethod, copy_rows, expect_shape
from stoker.quantization import formats
from stoker.quantization.config import WeightScheme

if TYPE_CHECKING:
    from stoker.kernels.cpu.decoder_layer import LinearSlots

BACKENDS = ("cpu_q8", "int8pack", "scaled_mm", "triton_w8", "dequant")



def scale_groups(scheme: WeightScheme, in_features: int) -> tuple[int, int]:
    """(G, group_k): the scale groups along a weight's `in_features` columns under `scheme`
    (per group, per 128-block, or one per channel), for dense and expert weights alike."""
    if scheme.strategy == "group":
        assert scheme.group_size is not None
        return -(-in_features // scheme.group_size), scheme.group_size
    if scheme.strategy == "block":
        assert scheme.block is not None
        return -(-in_features // scheme.block[1]), scheme.block[1]
    return 1, in_features

class QuantizedLinearMethod(FusedGateUpMixin, LinearMethod):
    def __init__(self, scheme: WeightScheme, online: bool, backend: str, fuse_silu_and_mul: bool = False,
                 activations: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown quantized backend {backend!r}")
        if activations not in ("auto", "int8"):
            raise ValueError(f"quantized activations {activations!r}: 'auto' or 'int8'")
        # "int8": a Q6_K weight runs W6A8 on cpu_q8 (process_after_loading decides, once)
        self.activations = activations
        self.held = "one-byte"  # or "q6" (6-bit panels, W6A8)
        self.scheme = scheme
        self.online = online
        self.backend = backend
        self.kind = scheme.dtype
        self.fuse_silu_and_mul = fuse_silu_and_mul and backend == "cpu_q8"
        self.storage_dtype = formats.STORAGE_DTYPES[scheme.dtype]
        self.group_k = 0  # set by create_weights
        # bound in process_after_loading: the kernel (or its twin, which tests may swap in) and
        # the forward of this backend
        self.kernel = None
        self._forward = self._not_loaded

    def describe(self) -> str:
        w6a8 = " held 6-bit (Q6_K), W6A8 (int8 activations)" if self.held == "q6" else ""
        return f"{self.scheme.dtype} {self.scheme.strategy}{w6a8} via {self.backend}"

    def _not_loaded(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a quantized projection runs only after models.loader.load_weights")

    # ---------------------------------------------------------------- parameters and loading
    def checkpoint_params(self, layer: Linear) -> tuple[str, ...]:
        if self.online:
            return ("weight",)
        names = (self.scheme.weight_name, self.scheme.scale_name)
        return names + (("input_scale",) if self.scheme.static_input_scale else ())

    def _num_groups(self, in_features: int) -> tuple[int, int]:
        return scale_groups(self.scheme, in_features)

    def checkpoint_slice(
        self, layer: Linear, param_name: str, shard: str | None, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        """A tensor-parallel rank's part of each checkpoint tensor: weights by rows and columns
        (packed int32 by four columns per value), per-channel scales by rows, per-group and
        per-block scales by rows and the groups / blocks of its columns; a per-tensor scale,
        input_scale, weight_shape and zero points whole. A cut that splits a group or block is
        refused: its scale would belong to two ranks."""
        if not layer.is_split or param_name in ("weight", "bias"):
            return super().checkpoint_slice(layer, param_name, shard, shape)
        rows, cols = layer.checkpoint_rows(shard), layer.checkpoint_cols()
        num_rows, k = layer.checkpoint_shape(shard)
        s = self.scheme
        if param_name == "weight_packed":
            expect_shape(shape, (num_rows, -(-k // 4)), param_name, shard)
            return rows, _aligned(cols, 4, "packed int32 columns", k)
        if param_name != s.scale_name or s.strategy == "tensor":
            return None
        if s.strategy == "channel":
            expect_shape(shape[:1], (num_rows,), param_name, shard)
            return (rows,)
        if s.strategy == "group":
            assert s.group_size is not None
            expect_shape(shape, (num_rows, -(-k // s.group_size)), param_name, shard)
            return rows, _aligned(cols, s.group_size, f"groups of {s.group_size}", k)
        assert s.block is not None
        bn, bk = s.block
        expect_shape(shape, (-(-num_rows // bn), -(-k // bk)), param_name, shard)
        return _aligned(rows, bn, f"blocks of {bn} rows", num_rows), _aligned(cols, bk, f"blocks of {bk} columns", k)

    def create_weights(self, layer: Linear) -> None:
        groups, self.group_k = self._num_groups(layer.in_features)
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=self.storage_dtype), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.ones(layer.out_features, groups, dtype=torch.float32), requires_grad=False)
        if self.scheme.static_input_scale:
            # Static activation scale of each shard (W8A8 static); the GEMM takes their max.
            layer.input_scale = nn.Parameter(torch.zeros(max(1, len(layer.shard_offsets)), dtype=torch.float32), requires_grad=False)

    def load(self, layer: Linear, param_name: str, shard: str | None, tensor: torch.Tensor) -> None:
        rows = layer.shard_rows(shard)
        num_rows, k = rows.stop - rows.start, layer.in_features
        where = f"{param_name}" + (f" (shard {shard!r})" if shard else "")
        if param_name == "bias":
            copy_rows(layer, layer.bias, shard, tensor, "bias")
        elif param_name == "weight" and self.online:
            if tensor.dtype not in formats.FLOAT_CHECKPOINT_DTYPES:
                raise ValueError(f"--quantization {self.scheme.dtype} quantizes a float checkpoint; {where} is {tensor.dtype}")
            if tuple(tensor.shape) != (num_rows, k):
                raise ValueError(f"shape mismatch for {where}: checkpoint {tuple(tensor.shape)}, expected {(num_rows, k)}")
            q, scale = formats.quantize_rows(tensor, self.scheme.dtype)
            with torch.no_grad():
                layer.weight[rows].copy_(q)
                layer.weight_scale[rows].copy_(scale)
        elif param_name in ("weight", "weight_packed"):
            if param_name != self.scheme.weight_name:
                raise ValueError(f"{where}: this checkpoint's scheme stores its weights as {self.scheme.weight_name!r}")
            q = formats.unpack_int32(tensor, k) if param_name == "weight_packed" else tensor
            if q.dtype != self.storage_dtype:
                raise ValueError(f"{where} is {q.dtype}; the checkpoint's quantization_config says {self.storage_dtype}")
            copy_rows(layer, layer.weight, shard, q, where)
        elif param_name == self.scheme.scale_name:
            s = self.scheme
            try:
                scale, group_k = formats.scale_rows(tensor, s.strategy, num_rows, k, s.group_size, s.block)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            assert group_k == self.group_k
            with torch.no_grad():
                layer.weight_scale[rows].copy_(scale)
        elif param_name == "input_scale" and self.scheme.static_input_scale:
            index = list(layer.shard_offsets).index(shard) if shard else 0
            with torch.no_grad():
                layer.input_scale[index] = tensor.float().reshape(-1).max()
        elif param_name == "weight_shape":  # the checkpoint's whole shape, whatever this rank holds
            whole = list(layer.checkpoint_shape(shard))
            if [int(v) for v in tensor.reshape(-1).tolist()] != whole:
                raise ValueError(f"{where} says {tensor.tolist()}, the layer expects {whole}")
        elif param_name == "weight_zero_point":
            if bool(tensor.ne(0).any()):
                raise ValueError(f"{where} holds non-zero zero points; only symmetric quantization is supported")
        else:
            raise ValueError(f"unexpected checkpoint tensor {where} for a {self.scheme.dtype} {self.scheme.strategy} projection")

    # ---------------------------------------------------------------- layout for the backend
    def process_after_loading(self, layer: Linear) -> None:
        """Re-lay the weights for the backend and bind the forward once (apply only calls it)."""
        if self.backend == "cpu_q8" and self._hold_q6(layer):
            return
        if self.backend == "cpu_q8":
            from stoker.kernels.cpu import linear as cpu_linear

            gate_up = self.fuse_silu_and_mul
            layer.weight_scale = nn.Parameter(cpu_linear.pack_scales(layer.weight_scale.data, self.storage_dtype, gate_up), requires_grad=False)
            layer.weight = nn.Parameter(cpu_linear.pack_linear_weight(layer.weight.data, gate_up=gate_up), requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(cpu_linear.pack_linear_weight(layer.bias.data.float(), gate_up=gate_up), requires_grad=False)
            self.kernel = cpu_linear.linear_q8
            self._forward = self._cpu_q8
        elif self.backend == "int8pack":
            layer.weight_scale = nn.Parameter(layer.weight_scale.data.reshape(-1).contiguous(), requires_grad=False)
            self._forward = self._int8pack
        elif self.backend == "scaled_mm":
            # _scaled_mm wants B = W^T column-major: the (N, K) row-major weight, transposed.
            layer.weight_scale = nn.Parameter(layer.weight_scale.data.reshape(1, -1).contiguous(), requires_grad=False)
            if self.scheme.static_input_scale:  # one activation scale for the merged GEMM: the shards' largest
                layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1, 1), requires_grad=False)
            from stoker.kernels.quant_gemv import gemv_w8

            self.gemv = gemv_w8
            self._forward = self._scaled_mm
        elif self.backend == "triton_w8":
            from stoker.kernels.quant_gemv import gemv_w8
            from stoker.kernels.w8_linear import w8_linear

            self.kernel = w8_linear
            self.gemv = gemv_w8
            self._forward = self._triton_w8
        else:
            self.kernel = reference.w8_linear
            self._forward = self._weight_only

    def _hold_q6(self, layer: Linear) -> bool:
        """W6A8 (--activation-dtype int8): re-lay a Q6_K weight (codes in [-32, 31], groups of 16
        whose scales factor into sub-scale x super-scale, K a multiple of 256) as 6-bit panels and
        bind linear_q6_a8; False (the one-byte panels follow) for any other weight."""
        if self.activations != "int8" or self.scheme.dtype != "int8" or self.group_k != 16:
            return False
        from stoker.kernels.cpu import linear as cpu_linear
        from stoker.kernels.cpu import linear_q6

        q = layer.weight.data
        if q.shape[1] % linear_q6.SUPER or bool((q < -32).any()) or bool((q > 31).any()):
            return False
        factors = linear_q6.factor_q6_scales(layer.weight_scale.data)
        if factors is None:
            return False
        sc, d = factors
        gate_up = self.fuse_silu_and_mul
        layer.weight = nn.Parameter(linear_q6.pack_q6_weight(q, sc, gate_up), requires_grad=False)
        layer.weight_scale = nn.Parameter(linear_q6.pack_q6_super_scales(d, gate_up), requires_grad=False)
        if layer.bias is not None:
            layer.bias = nn.Parameter(cpu_linear.pack_linear_weight(layer.bias.data.float(), gate_up=gate_up), requires_grad=False)
        self.held = "q6"
        self.kernel = linear_q6.linear_q6_a8
        self._forward = self._cpu_q6_a8
        return True

    # ---------------------------------------------------------------- forward
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self._forward(layer, x)

    def _cpu_q6_a8(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, layer.weight, layer.weight_scale, layer.out_features, layer.bias, self.fuse_silu_and_mul)

    def _cpu_q8(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, layer.weight, layer.weight_scale, self.group_k, layer.out_features, layer.bias, self.fuse_silu_and_mul)

    def apply_pre_activation(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """A fused [gate; up] layer's output before SiLU-and-mul, in panel order (LoRA adds to it)."""
        if self.held == "q6":
            return self.kernel(x, layer.weight, layer.weight_scale, layer.out_features, layer.bias, False)
        return self.kernel(x, layer.weight, layer.weight_scale, self.group_k, layer.out_features, layer.bias, False)

    def c_linear_slots(self, layer: Linear) -> LinearSlots | None:
        from stoker.kernels.cpu import decoder_layer
        from stoker.kernels.cpu import linear as cpu_linear

        from stoker.kernels.cpu import linear_q6

        if self.backend == "cpu_q8" and self.kernel is linear_q6.linear_q6_a8:
            return decoder_layer.linear_slots_q6_a8(layer.weight, layer.weight_scale, layer.bias, layer.out_features,
                                                    self.fuse_silu_and_mul)
        if self.backend != "cpu_q8" or self.kernel is not cpu_linear.linear_q8:
            return None
        return decoder_layer.linear_slots_q8(layer.weight, layer.weight_scale, self.group_k, layer.bias, layer.out_features,
                                             self.fuse_silu_and_mul)

    def _int8pack(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), layer.weight, layer.weight_scale.to(x.dtype))
        if layer.bias is not None:
            out = out + layer.bias
        return out.view(*x.shape[:-1], layer.out_features)

    def _scaled_mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if w8_route(x.numel() // x.shape[-1], x.shape[-1], self.group_k) == "gemv":  # decode: weight-only
            return self.gemv(x, layer.weight, layer.weight_scale.view(-1, 1), self.group_k, layer.bias)
        static = layer.input_scale if self.scheme.static_input_scale else None
        return _scaled_mm_linear(x, layer.weight, layer.weight_scale, static, layer.bias)

    def _weight_only(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, layer.weight, layer.weight_scale, self.group_k, layer.bias)

    def _triton_w8(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if w8_route(x.numel() // x.shape[-1], x.shape[-1], self.group_k, TRITON_W8_GEMV_ROWS) == "gemv":
            return self.gemv(x, layer.weight, layer.weight_scale, self.group_k, layer.bias)
        return self.kernel(x, layer.weight, layer.weight_scale, self.group_k, layer.bias)


TRITON_W8_GEMV_ROWS = 1  # triton_w8: the GEMV for single rows only (measured; see the docstring)


def w8_route(num_rows: int, in_features: int, group_k: int, max_rows: int | None = None) -> str:
    """The CUDA 8-bit backends' path for a call of `num_rows` rows: "gemv" (decode, weight-only
    GEMV, up to `max_rows` rows; None: as many as the GEMV serves) or "gemm" (the backend's own
    GEMM: the Triton tile kernel or _scaled_mm)."""
    from stoker.kernels.quant_gemv import supports

    if max_rows is not None and num_rows > max_rows:
        return "gemm"
    return "gemv" if supports(num_rows, in_features, group_k, 8) else "gemm"


def _aligned(part: slice, unit: int, what: str, total: int | None = None) -> slice:
    """`part` of a dimension in units of `unit` (its groups or blocks); it must start on a unit
    boundary and end on one, or at the dimension's end (`total`: the last group may be short)."""
    if part.start % unit or (part.stop % unit and part.stop != total):
        raise ValueError(f"tensor parallelism cuts this projection at [{part.start}, {part.stop}), which splits {what}; "
                         "choose a tensor_parallel_size whose parts align with the checkpoint's quantization")
    return slice(part.start // unit, -(-part.stop // unit))


def _scaled_mm_linear(
    x: torch.Tensor,  # (..., K) bf16/fp16
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (1, N) float32
    input_scale: torch.Tensor | None,  # (1, 1) float32: static W8A8; None: per-token dynamic
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """W8A8 FP8: activations quantized per token (dynamic) or with the checkpoint's static
    scale, then one FP8 GEMM with row-wise scales on both sides (out = (xq sx) (wq sw)^T)."""
    rows = x.reshape(-1, x.shape[-1])
    if input_scale is not None:
        x_scale = input_scale.expand(rows.shape[0], 1).contiguous()  # row-wise scaling wants (M, 1) for A too
    else:
        x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / formats.FP8_MAX).clamp(min=1e-12)
    xq = (rows.float() / x_scale).clamp(-formats.FP8_MAX, formats.FP8_MAX).to(formats.FP8_DTYPE)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=x.dtype,
                           bias=None if bias is None else bias.to(x.dtype))
    return out.view(*x.shape[:-1], weight.shape[0])
