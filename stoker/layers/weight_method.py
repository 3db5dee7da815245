"""The weight-method seam: how one projection stores, loads and applies its weight.

A model file builds `Linear` / `MergedLinear` / `LMHead` layers knowing only their shapes.
When the model is built (`models/loader.build_model`), each projection is given one
`LinearMethod`, chosen once for its representation (float, FP8, INT8) and its backend (the C
kernels on packed panels, MKL, Triton, torch), and the method creates the layer's parameters:

    create_weights(layer)              parameters in the stored representation
    load(layer, name, shard, tensor)   one checkpoint tensor (a merged layer's shard, or the whole)
    process_after_loading(layer)       re-layout for the backend (pack panels, transpose, ...)
    apply(layer, x)                    x (..., in) -> (..., out)

Nothing tests a weight's shape or dtype to guess its representation, and no call re-reads
the environment to pick a backend: both are fields of the method.

Tensor parallelism is the layer's shape, not a method: a sharded layer is built with this
rank's rows or columns (layers/linear.py), every method creates its parameters from that
shape, and `checkpoint_slice` says which part of each checkpoint tensor the rank reads (a
method knows its own scales' layout: per channel they follow the rows, per group or block
also the columns). The row-parallel all-reduce is the layer's, after any method.
LoRA plugs in as a wrapper method (layers/lora.LoRAMethod) whose `apply` is the base method's
plus x A^T B^T for the adapters of the rows in the batch; the base weight (float or quantized)
is untouched. The methods here are the float ones; the quantized ones are in
layers/quantized_method.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from stoker.quantization.formats import FLOAT_CHECKPOINT_DTYPES

if TYPE_CHECKING:
    from stoker.kernels.cpu.decoder_layer import LinearSlots
    from stoker.layers.linear import Linear


class LinearMethod:
    """Base: a float (out, in) weight and optional bias, shard-aware loading."""

    #: the representation, for logs and byte accounting ("float", "fp8", "int8")
    kind = "float"
    #: the method writes act(gate) * up itself for a [gate; up] layer (layers/linear.GateUpLinear)
    fuse_silu_and_mul = False

    def checkpoint_params(self, layer: Linear) -> tuple[str, ...]:
        """Names the checkpoint must hold for each shard (bias added by the layer when it has one)."""
        return ("weight",)

    def create_weights(self, layer: Linear) -> None:
        """Parameters on the current default device and dtype (build_model sets both)."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)

    def checkpoint_slice(
        self, layer: Linear, param_name: str, shard: str | None, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        """The part of the checkpoint tensor `param_name` (of `shard`, whole shape `shape`) this
        rank reads; None: all of it (always, for a layer that is not split). A part is cut only
        from a tensor of the whole shape the layer expects (else the error names both)."""
        if not layer.is_split:
            return None
        rows, k = layer.checkpoint_shape(shard)
        if param_name == "weight":
            expect_shape(shape, (rows, k), param_name, shard)
            return layer.checkpoint_rows(shard), layer.checkpoint_cols()
        if param_name == "bias":
            expect_shape(shape, (rows,), param_name, shard)
            return (layer.checkpoint_rows(shard),)
        return None

    def load(self, layer: Linear, param_name: str, shard: str | None, tensor: torch.Tensor) -> None:
        if param_name not in ("weight", "bias"):
            raise ValueError(f"unexpected checkpoint tensor {param_name!r} for an unquantized projection")
        if tensor.dtype not in FLOAT_CHECKPOINT_DTYPES:
            raise ValueError(
                f"{param_name} is {tensor.dtype}, but this projection runs unquantized (the config ignores it, or "
                "declares no quantization): an 8-bit weight would be read without its scale"
            )
        copy_rows(layer, getattr(layer, param_name), shard, tensor, param_name)

    def process_after_loading(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def describe(self) -> str:
        return type(self).__name__

    def c_linear_slots(self, layer: Linear) -> LinearSlots | None:
        """The projection as kernels/cpu/decoder_layer.c runs it (decoder_layer.linear_slots_*),
        or None: a method that is not one C kernel call on its own weights (torch, CUDA, LoRA,
        affine int8, a test's swapped-in twin) keeps the decode step in Python. A composite
        layer gives its runs' slots side by side when every run has them."""
        return None


def expect_shape(got: tuple[int, ...], expected: tuple[int, ...], name: str, shard: str | None) -> None:
    if tuple(got) != tuple(expected):
        where = f"shard {shard!r} of {name}" if shard else name
        raise ValueError(f"shape mismatch for {where}: checkpoint {tuple(got)}, expected {tuple(expected)}")


def copy_rows(layer: Linear, param: torch.Tensor, shard: str | None, tensor: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into `param`'s rows of `shard` (all rows when shard is None),
    checking its shape first; the message names the shard and the shapes. A vocabulary-parallel
    layer's last part may get fewer rows than it holds: the rest are zeroed."""
    rows = layer.shard_rows(shard)
    expected = (rows.stop - rows.start, *param.shape[1:])
    got = tuple(tensor.shape)
    short = layer.is_padded and len(got) == len(expected) and got[1:] == expected[1:] and got[0] < expected[0]
    if got != expected and not short:
        where = f"shard {shard!r} of {name}" if shard else name
        raise ValueError(f"shape mismatch for {where}: checkpoint {got}, expected {expected}")
    with torch.no_grad():
        param[rows][: got[0]].copy_(tensor)
        param[rows][got[0] :].zero_()


class TorchLinearMethod(LinearMethod):
    """Float weights through F.linear: CUDA (cuBLAS), other dtypes, any device."""


class ColumnMajorMethod(LinearMethod):
    """CPU without the C kernels: the (out, in) weight laid out column-major for MKL.

    The weight keeps its (out, in) shape, but its memory becomes (in, out) row-major, so
    `F.linear` hands MKL a non-transposed B. `benchmarks/cpu_kernels.py`: 1.9x at M = 8 and
    1.4x at M = 32 for in 512 / out 2816, equal at M = 1 and prefill sizes. Same memory.
    """

    def process_after_loading(self, layer: Linear) -> None:
        w = layer.weight.data
        layer.weight.data = w.t().contiguous().t()


class FusedGateUpMixin:
    """A CPU method whose [gate; up] layer may apply SiLU-and-mul itself (fuse_silu_and_mul).
    LoRA adds its update before the activation, so such a layer can also give its
    pre-activation (`apply_pre_activation`, columns in the kernel's panel order:
    `output_rows`) and then `activate` it, as the fused kernel would have."""

    fuse_silu_and_mul: bool

    def output_rows(self, layer: Linear) -> torch.Tensor:
        from stoker.kernels.cpu import linear as cpu_linear

        return cpu_linear.gate_up_rows(layer.out_features)

    def activate(self, pre: torch.Tensor) -> torch.Tensor:  # (T, 2I) panel order -> (T, I)
        from stoker.kernels.cpu import linear as cpu_linear

        return cpu_linear.silu_and_mul_panels(pre)


class PackedCpuMethod(FusedGateUpMixin, LinearMethod):
    """CPU float32 with the C kernels: the weight as (ceil(out / NR), in, NR) panels for
    `kernels/cpu/linear.c` (NR = 64 with AVX-512), each streamed once, contiguously.

    fuse_silu_and_mul (an MLP's [gate; up] projection whose activation is SiLU): gate and up
    columns sit side by side in each panel and the kernel writes silu(gate) * up, half as wide.
    `kernel` is the C kernel, or its torch twin (`reference.linear_packed`, for tests).
    """

    def __init__(self, fuse_silu_and_mul: bool = False) -> None:
        from stoker.kernels.cpu import linear as cpu_linear

        self.fuse_silu_and_mul = fuse_silu_and_mul
        self.kernel = cpu_linear.linear

    def process_after_loading(self, layer: Linear) -> None:
        from stoker.kernels.cpu import linear as cpu_linear

        layer.weight = nn.Parameter(cpu_linear.pack_linear_weight(layer.weight.data, gate_up=self.fuse_silu_and_mul), requires_grad=False)
        if layer.bias is not None:
            layer.bias = nn.Parameter(cpu_linear.pack_linear_weight(layer.bias.data, gate_up=self.fuse_silu_and_mul), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, layer.weight, layer.out_features, layer.bias, self.fuse_silu_and_mul)

    def apply_pre_activation(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, layer.weight, layer.out_features, layer.bias, False)

    def c_linear_slots(self, layer: Linear) -> LinearSlots | None:
        from stoker.kernels.cpu import decoder_layer
        from stoker.kernels.cpu import linear as cpu_linear

        if self.kernel is not cpu_linear.linear:
            return None
        return decoder_layer.linear_slots_f32(layer.weight, layer.bias, layer.out_features, self.fuse_silu_and_mul)


class TiedMethod(LinearMethod):
    """An LM head that shares the token embedding's (vocab, hidden) weight: nothing to create,
    load or re-lay (the embedding looks rows up, which wants them contiguous)."""

    def __init__(self, embedding_weight: nn.Parameter) -> None:
        self.embedding_weight = embedding_weight

    def checkpoint_params(self, layer: Linear) -> tuple[str, ...]:
        return ()

    def create_weights(self, layer: Linear) -> None:
        layer.weight = self.embedding_weight
