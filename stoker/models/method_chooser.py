"""Which weight method and backend each layer of a model gets, decided once when it is built.

`LinearMethodChooser(name, layer)` is called by `models/loader.build_with_methods` for every
projection, before its parameters exist:

  * the LM head: tied to the embedding (TiedMethod), else float, unless the config quantizes it
    (a GGUF file's quantized output tensor);
  * a MoE router (float32 whatever the model dtype) and Qwen2-MoE's shared_expert_gate: float,
    never quantized;
  * a projection the quantization config covers (and does not ignore): QuantizedLinearMethod
    with its backend (stoker/layers/quantized_method.py lists them), or for 4-bit weights
    Int4LinearMethod (stoker/layers/int4_method.py: the C kernels' nibble panels on CPU float32,
    the Triton W4A16 GEMM on CUDA, dequantized in torch elsewhere);
  * float projections: the C kernels' packed panels on CPU float32 when they are built
    (PackedCpuMethod, with SiLU-and-mul fused into a SiLU-gated [gate; up] layer),
    MKL's column-major layout on CPU without them, F.linear otherwise.
`LinearMethodChooser.moe(name, layer)` gives every FusedMoE its MoEMethod (layers/moe.py).
`bind_kernels` gives every attention, norm, rotary and activation layer the kernel set of the
model's device and dtype (kernels/ops.py: Triton, the C kernels or the torch twins).
The environment (STOKER_DISABLE_CPU_KERNELS, STOKER_DISABLE_TRITON) is read here, once.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from stoker.kernels import ops
from stoker.kernels.cpu import build as cpu_kernels
from stoker.layers.attention import Attention
from stoker.layers.embedding import LMHead
from stoker.layers.linear import GateUpLinear, Linear
from stoker.layers.moe import FusedMoE, MoEMethod, PackedCpuMoEMethod, TorchMoEMethod
from stoker.layers.moe_router import RouterLinear
from stoker.layers.weight_method import ColumnMajorMethod, LinearMethod, PackedCpuMethod, TiedMethod, TorchLinearMethod
from stoker.models.packed import checkpoint_module_name
from stoker.quantization.config import QuantConfig, QuantizationError, WeightScheme

logger = logging.getLogger(__name__)


def fp8_matmul_supported(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantized_backend(scheme: WeightScheme, device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cpu":
        if dtype == torch.float32 and cpu_kernels.available():
            return "cpu_q8"
        if scheme.dtype == "int8" and scheme.strategy in ("tensor", "channel") and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            return "int8pack"
        return "dequant"
    if device.type == "cuda":
        if scheme.dtype == "fp8" and scheme.quantized_activations and scheme.strategy in ("tensor", "channel") and fp8_matmul_supported(device):
            return "scaled_mm"
        if ops.triton_available() and not ops.triton_disabled():
            return "triton_w8"
    return "dequant"


def int4_backend(scheme: WeightScheme, device: torch.device, cpu_kernels: bool) -> str:
    """cpu_q4 with the C kernels; on CUDA the Triton W4A16 GEMM when its K tiles fit the groups
    (a multiple of 32 columns, or one group per row); else the dequantizing twin."""
    if cpu_kernels:
        return "cpu_q4"
    if device.type == "cuda" and ops.triton_available() and not ops.triton_disabled():
        from stoker.kernels.w4a16_linear import MIN_BLOCK_K

        if scheme.strategy != "group" or (scheme.group_size or 0) % MIN_BLOCK_K == 0:
            return "triton_w4a16"
    return "dequant"


@dataclass
class LinearMethodChooser:
    quant: QuantConfig | None
    device: torch.device
    dtype: torch.dtype
    model: nn.Module
    chosen: Counter = field(default_factory=Counter)
    weight_only_said: bool = False

    def __post_init__(self) -> None:
        self.cpu_kernels = self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.available()

    def __call__(self, name: str, layer: Linear) -> LinearMethod:
        method = self._choose(name, layer)
        self.chosen[method.describe()] += 1
        return method

    def _choose(self, name: str, layer: Linear) -> LinearMethod:
        if isinstance(layer, LMHead):
            if layer.tied_embedding is not None:
                return TiedMethod(layer.tied_embedding.weight)
            if self.quant is None or not self.quant.quantizes_lm_head:
                return self._float(name, layer)
        if isinstance(layer, RouterLinear):
            return self._float(name, layer)  # a discrete choice: never quantized, always float32
        if name.endswith(".shared_expert_gate"):
            return self._float(name, layer)  # Qwen2-MoE's one-logit gate: never quantized (as vLLM)
        if self.quant is not None and not self.quant.experts_only:  # mxfp4 quantizes only MoE experts
            names = [checkpoint_module_name(self.model, name, shard) for shard in layer.shard_offsets] or [name]
            # a merged layer whose shards a GGUF file stores in different representations
            runs = self.quant.shard_runs(names) if len(names) > 1 and hasattr(self.quant, "shard_runs") else []
            if len(runs) > 1:
                from stoker.layers.composite_method import composite_method

                shards = list(layer.shard_offsets)
                return composite_method(name, layer, [([shards[i] for i in idx], s) for idx, s in runs],
                                        lambda part, scheme: self._for_scheme(name, part, scheme))
            ignored = [self.quant.is_ignored(n) for n in names]
            if any(ignored) and not all(ignored):
                self.quant.weights_for(names)  # a config with a scheme per tensor (GGUF) says which types clash
                raise QuantizationError(
                    f"the quantization config ignores {[n for n, i in zip(names, ignored) if i]} but not "
                    f"{[n for n, i in zip(names, ignored) if not i]}; Stoker runs them as one GEMM, so they must agree"
                )
            # one scheme per checkpoint; per tensor in a GGUF file (Q4_0 int4 beside Q8_0 int8)
            scheme = None if all(ignored) else self.quant.weights_for(names)
            return self._for_scheme(name, layer, scheme)
        return self._float(name, layer)

    def _for_scheme(self, name: str, layer: Linear, scheme: WeightScheme | None) -> LinearMethod:
        """The method and backend of a projection stored under `scheme` (None: float)."""
        assert self.quant is not None
        if scheme is not None and scheme.dtype == "int8" and not scheme.symmetric:  # GGUF Q5_K / Q5_1
            from stoker.layers.int8_affine_method import AffineInt8LinearMethod

            assert scheme.group_size is not None
            return AffineInt8LinearMethod(scheme.group_size, "cpu_q8" if self.cpu_kernels else "dequant", name)
        if scheme is not None and scheme.dtype == "int4":
            from stoker.layers.int4_method import Int4LinearMethod

            backend = int4_backend(scheme, self.device, self.cpu_kernels)
            activations = self.quant.activation_dtype
            if activations != "auto" and backend != "cpu_q4":
                raise QuantizationError(
                    f"--activation-dtype {activations} (W4A8) runs on the CPU kernels with a float32 model; {name} runs "
                    f"on {self.device} in {str(self.dtype).removeprefix('torch.')} ({backend}): use --activation-dtype auto")
            return Int4LinearMethod(scheme, self.quant.online, backend, self._fuse_silu(name, layer, backend), name,
                                    activations, self.dtype)
        if scheme is not None:
            from stoker.layers.quantized_method import QuantizedLinearMethod

            backend = quantized_backend(scheme, self.device, self.dtype)
            if scheme.quantized_activations and backend != "scaled_mm" and not self.weight_only_said:
                # Not dropped silently: the activations stay in the model dtype, which only
                # removes a rounding the scheme allowed (W8A16 instead of W8A8).
                logger.info("the %s scheme quantizes activations too; on %s (%s) Stoker runs it weight-only, "
                            "activations in %s", self.quant.method, self.device, backend, str(self.dtype).removeprefix("torch."))
                self.weight_only_said = True
            # --activation-dtype int8: a Q6_K weight on cpu_q8 runs W6A8 (layers/quantized_method.py)
            activations = self.quant.activation_dtype if backend == "cpu_q8" else "auto"
            return QuantizedLinearMethod(scheme, self.quant.online, backend, self._fuse_silu(name, layer, backend),
                                         activations)
        return self._float(name, layer)

    def _float(self, name: str, layer: Linear) -> LinearMethod:
        if self.cpu_kernels:
            return PackedCpuMethod(self._fuse_silu(name, layer, "cpu"))
        if self.device.type == "cpu":
            return ColumnMajorMethod()
        return TorchLinearMethod()

    def _fuse_silu(self, name: str, layer: Linear, backend: str) -> bool:
        """A SiLU-gated [gate; up] layer, on a CPU kernel that can fuse it."""
        from stoker.kernels.cpu import linear as cpu_linear

        if backend not in ("cpu", "cpu_q8", "cpu_q4") or not isinstance(layer, GateUpLinear) or not layer.is_silu:
            return False
        return cpu_linear.gate_up_fusable(layer.out_features // 2)

    def moe(self, name: str, layer: FusedMoE) -> MoEMethod:
        """A FusedMoE's method: quantized experts when the config covers them
        (layers/moe_quant.py: the C kernels' one-byte panels on CPU float32, the Triton fused-MoE
        kernel on CUDA, dequantized in torch elsewhere; 4-bit ones layers/moe_int4.py: the C
        MoE kernel dequantizing a panel per task on CPU float32, torch per expert elsewhere; a
        GGUF layer whose gate/up and down differ in type, layers/moe_mixed.py, likewise),
        else float experts: on CPU float32
        through the C kernels' panels (SiLU fused when I fills whole panels), on CUDA through
        the Triton fused-MoE kernel (layers/moe_triton.py), else plain torch."""
        from stoker.kernels.cpu import linear as cpu_linear

        method: MoEMethod
        # the Triton kernel applies hidden_act itself and adds no expert biases (gpt-oss has both)
        triton_moe = (self.device.type == "cuda" and ops.triton_available() and not ops.triton_disabled()
                      and not layer.custom_activation and not layer.has_bias)
        if self.quant is not None and self.quant.experts_only:
            method = self._mxfp4(name, layer)
        elif (pair := self._expert_projections(name, layer)) is not None:
            from stoker.layers.moe_mixed import MixedMoEMethod

            # a GGUF layer whose gate/up and down differ (Q4_K_M's Q4_K beside Q6_K; Q5_K_M): each in its own codes
            method = MixedMoEMethod(*pair, "cpu" if self.cpu_kernels else "dequant", name)
        elif self.quant is not None and self._experts_scheme(name, layer).dtype == "int4" \
                and self._experts_quantized(name, layer):
            from stoker.layers.moe_int4 import Int4MoEMethod

            # moe.c dequantizes each GEMM task's panel on CPU float32; torch dequantizes per expert elsewhere
            method = Int4MoEMethod(self._experts_scheme(name, layer), self.quant.online,
                                   "cpu" if self.cpu_kernels else "dequant", name)
        elif self.quant is not None and self._experts_quantized(name, layer):
            from stoker.layers.moe_quant import QuantizedMoEMethod

            # the checkpoint's scheme; a GGUF file's is its expert tensors' own (their finest group)
            w = self._experts_scheme(name, layer)
            group = w.group_size if w.strategy == "group" else w.block[1] if w.strategy == "block" and w.block else None
            # the kernel reads one scale per K tile: a group of K that is not a multiple of 16 does not tile
            triton_groups = group is None or group % 16 == 0
            backend = "cpu_q8" if self.cpu_kernels else "triton" if triton_moe and triton_groups else "dequant"
            self._say_weight_only(backend)
            fuse = (backend == "cpu_q8" and layer.is_silu and not layer.has_bias
                    and cpu_linear.gate_up_fusable(layer.intermediate_size))
            method = QuantizedMoEMethod(w, self.quant.online, backend, fuse)
        elif self.cpu_kernels:
            fuse = layer.is_silu and not layer.has_bias and cpu_linear.gate_up_fusable(layer.intermediate_size)
            method = PackedCpuMoEMethod(fuse)
        elif triton_moe:
            from stoker.layers.moe_triton import TritonMoEMethod

            method = TritonMoEMethod()
        else:
            method = TorchMoEMethod()
        self.chosen[method.describe()] += 1
        return method

    def _mxfp4(self, name: str, layer: FusedMoE) -> MoEMethod:
        """gpt-oss's MXFP4 experts, held 4-bit (layers/moe_mxfp4.py; under tensor parallelism
        I / tp must be whole blocks of 32, which the method checks)."""
        from stoker.layers.moe_mxfp4 import Mxfp4MoEMethod

        return Mxfp4MoEMethod("cpu" if self.cpu_kernels else "dequant")

    def _expert_projections(self, name: str, layer: FusedMoE) -> tuple[WeightScheme, WeightScheme] | None:
        """(gate/up, down) schemes when the config holds this layer's experts per projection (a
        GGUF file's, quantization/gguf.py expert_projections), else None."""
        if self.quant is None or not hasattr(self.quant, "expert_projections"):
            return None
        return self.quant.expert_projections(self._expert_module_names(name, layer))

    def _experts_scheme(self, name: str, layer: FusedMoE) -> WeightScheme:
        """The scheme the config holds this layer's experts in: the checkpoint's one scheme; a GGUF
        file's, its expert tensors' own (quantization/gguf.py expert_scheme), float ones aside."""
        assert self.quant is not None
        names = self._expert_module_names(name, layer)
        if all(self.quant.is_ignored(n) for n in names):
            return self.quant.weights  # float experts: _experts_quantized says so
        return self.quant.weights_for(names)

    def _experts_quantized(self, name: str, layer: FusedMoE) -> bool:
        """Whether the config quantizes this layer's experts: all of them, or none (then they load
        as floats); an ignore list that splits them is refused, as for a merged projection."""
        assert self.quant is not None
        names = self._expert_module_names(name, layer)
        ignored = [self.quant.is_ignored(n) for n in names]
        if any(ignored) and not all(ignored):
            raise QuantizationError(
                f"the quantization config ignores some experts of {name} ({[n for n, i in zip(names, ignored) if i][:3]} ...) "
                "but not all; Stoker holds a layer's experts in one representation, so they must agree"
            )
        if all(ignored):
            return False
        # int4 experts (a GGUF file's: its expert tensors' own scheme) are cut at whole groups
        if not self.quant.online and layer.is_split and self._experts_scheme(name, layer).dtype != "int4":
            raise QuantizationError(
                f"pre-quantized Mixture-of-Experts experts ({name}) under tensor parallelism are not supported yet; "
                "run with --tensor-parallel-size 1, or quantize a float checkpoint online (--quantization)"
            )
        return True

    def _expert_module_names(self, name: str, layer: FusedMoE) -> list[str]:
        """The checkpoint module names of this layer's experts ({name}.{e}.gate_proj, ...)."""
        leaves = list(getattr(self.model, "expert_params", {})) or ["weight"]
        return [f"{name}.{e}.{leaf}" for e in range(layer.num_experts) for leaf in leaves]

    def _say_weight_only(self, backend: str) -> None:
        assert self.quant is not None
        if self.quant.weights.quantized_activations and not self.weight_only_said:
            logger.info("the %s scheme quantizes activations too; Stoker runs the experts weight-only (%s), activations "
                        "in %s", self.quant.method, backend, str(self.dtype).removeprefix("torch."))
            self.weight_only_said = True

    def summary(self) -> str:
        return ", ".join(f"{n} x {m}" for m, n in sorted(self.chosen.items()))


def bind_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Give each layer that runs a kernel of its own (attention, norms, rotary, the gated
    activation) the set for `device` and `dtype`; returns the set's name, for the log."""
    kernels = ops.select(device, dtype)
    for module in model.modules():
        if isinstance(module, Attention):  # its prefill kernel depends on head_dim
            module.kernels = ops.select(device, dtype, module.head_dim)
            if module.with_sinks and module.kernels.name == "triton":  # the Triton kernels take no sinks yet
                module.kernels = ops.TORCH
        elif isinstance(getattr(module, "kernels", None), ops.Kernels):
            module.kernels = kernels
    return kernels.name
