"""Quantized Mixture-of-Experts experts: FP8 (E4M3) or INT8 weights, float32 scales per
expert, output row and group of K, with the four verbs of `MoEMethod` (layers/moe.py).

    w13        (E, 2I, H)  int8 / float8_e4m3fn   each expert's [gate; up] rows
    w13_scale  (E, 2I, G13) float32               G13 = ceil(H / group_k13); 1 per channel
    w2         (E, H, I)   int8 / float8_e4m3fn
    w2_scale   (E, H, G2)  float32

The representation is the dense quantized projection's (quantization/formats.py: qweight
(N, K), scale (N, G), dequantized = qweight * scale over each group), expert by expert, so
every strategy the dense path reads (per tensor, channel, group, 128 x 128 blocks) is brought
to it by the same `formats.scale_rows`, and gate and up keep their own scales (two shards of
one expert, as a merged gate/up projection's).

Loading: online (`--quantization fp8|int8`), each float expert tensor is quantized per output
row as it is read, so no float copy of the experts exists. Pre-quantized, each expert's
tensors come by their checkpoint names (`experts.{e}.gate_proj.weight`, `.weight_scale`,
`.weight_scale_inv`, `.weight_packed`, ...) as shard `(expert, "w1" | "w2" | "w3")` and
parameter name.

Backends, chosen once at build (models/method_chooser.py):
  cpu_q8   CPU float32 with the C kernels: each expert's w13 and w2 as one-byte panels of
           the dense linear kernel (`cpu_linear.linear_q8`, the same panels and scales the
           dense `QuantizedLinearMethod` uses), SiLU-and-mul fused when I fills whole panels.
  triton   CUDA with Triton: the fused-MoE kernel (kernels/fused_moe.py) reads the one-byte
           weights and their scales as stored here and dequantizes each tile in registers;
           one call per layer, no host sync (CUDA graphs hold it).
  dequant  anything else: each routed expert's weights dequantized in torch on the fly
           (`reference.w8_linear`), one expert at a time. Correct, not fast.
Both are weight-only: activations stay in the model dtype (a W8A8 scheme's activation
quantization is not applied; the chooser logs it).
"""

from __future__ import annotations

import torch
from torch import nn

from stoker.kernels import reference
from stoker.layers.moe import EXPERT_SHARDS, FusedMoE, MoEMethod
from stoker.layers.quantized_method import scale_groups
from stoker.layers.weight_method import expect_shape
from stoker.quantization import formats
from stoker.quantization.config import WeightScheme

MOE_BACKENDS = ("cpu_q8", "triton", "dequant")


class QuantizedMoEMethod(MoEMethod):
    graph_capturable = False  # the per-expert loop reads token counts on the host, as the float one

    def __init__(self, scheme: WeightScheme, online: bool, backend: str, fuse_silu_and_mul: bool = False) -> None:
        if backend not in MOE_BACKENDS:
            raise ValueError(f"unknown quantized MoE backend {backend!r}; one of {MOE_BACKENDS}")
        self.scheme = scheme
        self.online = online
        self.backend = backend
        self.kind = scheme.dtype
        self.fuse_silu_and_mul = fuse_silu_and_mul and backend == "cpu_q8"
        self.storage_dtype = formats.STORAGE_DTYPES[scheme.dtype]
        self.group_k13 = 0  # columns of H per w13 scale; set by create_weights
        self.group_k2 = 0  # columns of I per w2 scale
        self.kernel = None  # cpu_linear.linear_q8 (cpu_q8), bound after loading; tests may swap in a twin
        # the Triton kernel aligns the pairs on the device; the per-expert loops read counts on the host
        self.graph_capturable = backend == "triton"
        self.activation = "silu"  # the Triton kernel's gate, from the layer's hidden_act (create_weights)
        if backend == "triton":
            from stoker.kernels import fused_moe

            self.fused_moe = fused_moe.fused_moe  # or its twin reference.fused_moe_grouped, for tests

    def describe(self) -> str:
        fused = ", fused silu" if self.fuse_silu_and_mul else ""
        return f"experts {self.scheme.dtype} {self.scheme.strategy} via {self.backend}{fused}"

    # ---------------------------------------------------------------- parameters
    def _groups(self, in_features: int) -> tuple[int, int]:
        """(G, group_k) for a weight of `in_features` columns, as the dense method counts them."""
        return scale_groups(self.scheme, in_features)

    def checkpoint_params(self) -> tuple[str, ...]:
        if self.online:
            return ("weight",)
        names = (self.scheme.weight_name, self.scheme.scale_name)
        return names + (("input_scale",) if self.scheme.static_input_scale else ())

    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        if self.backend == "triton":
            from stoker.layers.moe_triton import kernel_activation

            self.activation = kernel_activation(layer.hidden_act)
        g13, self.group_k13 = self._groups(h)
        g2, self.group_k2 = self._groups(i)
        layer.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=self.storage_dtype), requires_grad=False)
        layer.w13_scale = nn.Parameter(torch.ones(e, 2 * i, g13, dtype=torch.float32), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(e, h, i, dtype=self.storage_dtype), requires_grad=False)
        layer.w2_scale = nn.Parameter(torch.ones(e, h, g2, dtype=torch.float32), requires_grad=False)
        self.create_biases(layer)  # w13_bias, w2_bias in the model dtype (gpt-oss), never quantized

    def checkpoint_slice(
        self, layer: FusedMoE, shard: str, param: str, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        if param in ("weight", "weight_packed") and not self.online and layer.is_split:
            # Per-channel scales would cut cleanly, blocks and groups only when aligned: not built
            # yet, so the chooser refuses pre-quantized experts under tensor parallelism.
            raise ValueError("pre-quantized experts under tensor parallelism are not supported")
        if param == "weight":
            return layer.checkpoint_slice(shard, shape)
        if param == "bias":
            return layer.bias_slice(shard, shape)
        return None

    # ---------------------------------------------------------------- loading
    def load(self, layer: FusedMoE, expert: int, shard: str, tensor: torch.Tensor, param: str = "weight") -> None:
        if param == "bias":
            return self.load_bias(layer, expert, shard, tensor)
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} does not exist: the config has num_experts {layer.num_experts}")
        i = layer.intermediate_size
        rows = {"w1": slice(0, i), "w3": slice(i, 2 * i), "w2": slice(0, layer.hidden_size)}[shard]
        weight = layer.w2[expert] if shard == "w2" else layer.w13[expert]  # (N, K) this shard's rows of it
        scale = layer.w2_scale[expert] if shard == "w2" else layer.w13_scale[expert]
        num_rows, k = rows.stop - rows.start, weight.shape[1]
        where = f"expert {expert} {shard} {param}"
        if param == "weight" and self.online:
            if tensor.dtype not in formats.FLOAT_CHECKPOINT_DTYPES:
                raise ValueError(f"--quantization {self.scheme.dtype} quantizes a float checkpoint; {where} is {tensor.dtype}")
            expect_shape(tuple(tensor.shape), (num_rows, k), f"expert {expert}", shard)
            q, s = formats.quantize_rows(tensor, self.scheme.dtype)  # (N, K), (N, 1)
            with torch.no_grad():
                weight[rows].copy_(q)
                scale[rows].copy_(s)
        elif param in ("weight", "weight_packed"):
            if param != self.scheme.weight_name:
                raise ValueError(f"{where}: this checkpoint's scheme stores its weights as {self.scheme.weight_name!r}")
            q = formats.unpack_int32(tensor, k) if param == "weight_packed" else tensor
            if q.dtype != self.storage_dtype:
                raise ValueError(f"{where} is {q.dtype}; the checkpoint's quantization_config says {self.storage_dtype}")
            expect_shape(tuple(q.shape), (num_rows, k), f"expert {expert}", shard)
            with torch.no_grad():
                weight[rows].copy_(q)
        elif param == self.scheme.scale_name and not self.online:
            s = self.scheme
            try:
                rows_scale, _ = formats.scale_rows(tensor, s.strategy, num_rows, k, s.group_size, s.block)  # (N, G)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            with torch.no_grad():
                scale[rows].copy_(rows_scale)
        elif param == "input_scale" and self.scheme.static_input_scale:
            if tensor.numel() != 1:
                raise ValueError(f"{where}: a static input scale is one value, got shape {tuple(tensor.shape)}")
            # read and checked, not used: the experts run weight-only (activations unquantized)
        elif param == "weight_shape" and not self.online:
            whole = [layer.hidden_size, layer.checkpoint_intermediate_size] if shard == "w2" else \
                [layer.checkpoint_intermediate_size, layer.hidden_size]
            if [int(v) for v in tensor.reshape(-1).tolist()] != whole:
                raise ValueError(f"{where} says {tensor.tolist()}, the layer expects {whole}")
        elif param == "weight_zero_point" and not self.online:
            if bool(tensor.ne(0).any()):
                raise ValueError(f"{where} holds non-zero zero points; only symmetric quantization is supported")
        else:
            raise ValueError(f"unexpected checkpoint tensor {where} for {self.scheme.dtype} {self.scheme.strategy} experts")

    # ---------------------------------------------------------------- layout and forward
    def process_after_loading(self, layer: FusedMoE) -> None:
        if self.backend != "cpu_q8":
            self.kernel = reference.w8_linear
            return
        from stoker.kernels.cpu import linear as cpu_linear
        from stoker.kernels.cpu import moe as cpu_moe

        if layer.has_bias:  # (E, P * NR): padded to the panels, as linear_q8 reads a bias
            layer.w13_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w13_bias.data), requires_grad=False)
            layer.w2_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w2_bias.data), requires_grad=False)

        fuse, dt = self.fuse_silu_and_mul, self.storage_dtype
        # The dense quantized method's panels and scale layout, one expert at a time:
        # w13 (E, P13, H, NR), w13_scale (E, G13, P13 * NR); w2 (E, P2, I, NR), w2_scale (E, G2, P2 * NR).
        layer.w13_scale = nn.Parameter(torch.stack([cpu_linear.pack_scales(s, dt, fuse) for s in layer.w13_scale.data]),
                                       requires_grad=False)
        layer.w13 = nn.Parameter(torch.stack([cpu_linear.pack_linear_weight(w, gate_up=fuse) for w in layer.w13.data]),
                                 requires_grad=False)
        layer.w2_scale = nn.Parameter(torch.stack([cpu_linear.pack_scales(s, dt) for s in layer.w2_scale.data]),
                                      requires_grad=False)
        layer.w2 = nn.Parameter(torch.stack([cpu_linear.pack_linear_weight(w) for w in layer.w2.data]), requires_grad=False)
        self.kernel = cpu_linear.linear_q8

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H) -> (T, H)
        if self.backend != "triton":
            return super().apply(layer, x, topk_weights, topk_ids)
        return self.fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, self.activation,
                              layer.w13_scale, layer.w2_scale, self.group_k13, self.group_k2)

    def expert_forward(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        i, h = layer.intermediate_size, layer.hidden_size
        b13, b2 = (layer.w13_bias[e], layer.w2_bias[e]) if layer.has_bias else (None, None)
        if self.backend == "cpu_q8":
            up = self.kernel(rows, layer.w13[e], layer.w13_scale[e], self.group_k13, 2 * i, b13, self.fuse_silu_and_mul)
            act = up if self.fuse_silu_and_mul else layer.act(up)  # (n, I)
            return self.kernel(act, layer.w2[e], layer.w2_scale[e], self.group_k2, h, b2, False)
        act = layer.act(self.kernel(rows, layer.w13[e], layer.w13_scale[e], self.group_k13, b13))  # dequantized per call
        return self.kernel(act, layer.w2[e], layer.w2_scale[e], self.group_k2, b2)
