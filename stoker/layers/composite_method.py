"""A merged projection whose shards are stored in different representations.

A GGUF file types each tensor on its own, and llama.cpp's Q4_K_M puts some layers' v (and
Q4_K_S's first layers' v) in a wider type than their q and k (Q4_K q/k beside a Q6_K or Q5_K
v); Stoker runs q/k/v (and gate/up) as one merged layer. No one method holds 4-bit and 8-bit
codes, so such a layer gets `CompositeLinearMethod`: its shards, in order, are cut into runs
that share a representation, each run is a sub-projection (a MergedLinear of those shards)
with the method that representation gets anywhere else, and the layer's output is the runs'
outputs side by side, which is the merged layer's shard order:

    x (..., K) -> cat([run_0(x) (..., N_0), run_1(x) (..., N_1), ...], dim=-1) (..., N)

Why this and not separate q, k, v layers for such a layer: the model files build one merged
layer and never branch on representation (the weight-method seam: a method per projection,
chosen once at build); un-merging would make the attention module's shape depend on the file.
Each run is an ordinary method, so it is batch-invariant as they are, and the concatenation
adds no arithmetic. The runs' GEMMs read the activations once each (two or three instead of
one), and a [gate; up] pair split this way is not fused with SiLU-and-mul (the layer's
epilogue applies it); llama.cpp's k-quant mixes type gate and up alike, so that case is rare.

Loading goes to the run that holds the shard (its method's `load`, `checkpoint_slice`,
`load_affine`); tensor parallelism cuts each shard as the run's method cuts any shard (rows per
shard, groups kept whole). The runs' parameters are registered on the merged layer as
`part{i}_{name}`, so the model's byte count (runner weight_bytes_held) and state_dict see them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from stoker.layers.linear import Linear, MergedLinear
from stoker.layers.weight_method import LinearMethod

if TYPE_CHECKING:
    from stoker.kernels.cpu.decoder_layer import LinearSlots


class CompositeLinearMethod(LinearMethod):
    def __init__(self, runs: Sequence[tuple[tuple[str, ...], LinearMethod]], name: str = "projection") -> None:
        if len(runs) < 2:
            raise ValueError(f"{name}: a composite method has two or more runs of shards")
        self.runs = [(tuple(shards), method) for shards, method in runs]
        self.name = name
        self.kind = "+".join(dict.fromkeys(m.kind for _, m in self.runs))
        self.parts: list[MergedLinear] = []  # built by create_weights, one per run
        self.part_of: dict[str, MergedLinear] = {}

    def describe(self) -> str:
        return "composite [" + " | ".join(f"{','.join(s)}: {m.describe()}" for s, m in self.runs) + "]"

    def create_weights(self, layer: Linear) -> None:
        order = [s for shards, _ in self.runs for s in shards]
        if order != list(layer.shard_offsets):
            raise ValueError(f"{self.name}: runs {order} are not the layer's shards {list(layer.shard_offsets)} in order")
        if not layer.in_split.is_whole:
            raise ValueError(f"{self.name}: a composite method serves column-parallel merged layers only")
        for shards, method in self.runs:
            part = MergedLinear(layer.checkpoint_in_features, {s: layer.checkpoint_shards[s][0] for s in shards},
                                layer.has_bias, out_splits={s: layer.checkpoint_shards[s][1] for s in shards})
            part.attach(method)
            self.parts.append(part)
            self.part_of.update(dict.fromkeys(shards, part))
        self._expose(layer)

    def _expose(self, layer: Linear) -> None:
        for i, part in enumerate(self.parts):
            for pname, p in part.named_parameters(recurse=False):
                layer.register_parameter(f"part{i}_{pname}", p)

    def _part(self, shard: str | None) -> MergedLinear:
        if shard not in self.part_of:
            raise ValueError(f"{self.name}: a composite layer loads shard by shard, and has no shard {shard!r}")
        return self.part_of[shard]

    def checkpoint_params(self, layer: Linear) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for part in self.parts for p in part.method.checkpoint_params(part)))

    def shard_checkpoint_params(self, layer: Linear, shard: str | None) -> tuple[str, ...]:
        """What the checkpoint holds for `shard`: its run's method's names (models/loader.py)."""
        part = self._part(shard)
        return part.method.checkpoint_params(part)

    def checkpoint_slice(self, layer: Linear, param_name: str, shard: str | None,
                         shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        part = self._part(shard)
        return part.method.checkpoint_slice(part, param_name, shard, shape)

    def load(self, layer: Linear, param_name: str, shard: str | None, tensor: torch.Tensor) -> None:
        part = self._part(shard)
        part.method.load(part, param_name, shard, tensor)

    def load_affine(self, layer: Linear, shard: str | None, weight: object) -> None:
        """A tensor a loader decoded itself (int4.AffineInt4, int8_affine_method.AffineInt8)."""
        part = self._part(shard)
        if not hasattr(part.method, "load_affine"):
            raise ValueError(f"{self.name}: shard {shard!r} runs {part.method.describe()}, which takes checkpoint tensors, "
                             "not a decoded weight")
        part.method.load_affine(part, shard, weight)

    def process_after_loading(self, layer: Linear) -> None:
        for part in self.parts:
            part.method.process_after_loading(part)
        layer.register_parameter("bias", None)  # each run adds its shards' bias
        self._expose(layer)  # methods re-lay their parameters into new ones

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.method.apply(part, x) for part in self.parts], dim=-1)

    def c_linear_slots(self, layer: Linear) -> LinearSlots | None:
        """The runs side by side, each writing its columns of the output (decoder_layer.c), when
        every run is one C kernel call."""
        from stoker.kernels.cpu.decoder_layer import LinearSlots

        parts = [part.method.c_linear_slots(part) for part in self.parts]
        if any(p is None for p in parts):
            return None
        return LinearSlots.side_by_side(parts)  # type: ignore[arg-type]


def composite_method(name: str, layer: Linear, runs: Sequence[tuple[Sequence[str], object]],
                     method_for: Callable[[Linear, object], LinearMethod]) -> CompositeLinearMethod:
    """The composite method of merged `layer` for `runs` ((shard names, the run's scheme), in
    shard order); `method_for(sub_layer, scheme)` is the method chooser's pick for a layer of
    one representation. The sub-layers it is asked about are built from `layer`'s shards."""
    methods = []
    for shards, scheme in runs:
        probe = MergedLinear(layer.checkpoint_in_features, {s: layer.checkpoint_shards[s][0] for s in shards},
                             layer.has_bias, out_splits={s: layer.checkpoint_shards[s][1] for s in shards})
        methods.append((tuple(shards), method_for(probe, scheme)))
    return CompositeLinearMethod(methods, name)
