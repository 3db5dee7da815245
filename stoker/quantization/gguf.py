"""GGUF tensor types -> Stoker weight schemes, one per projection. [no torch]

A GGUF file stores each tensor in its own type (a Q4_K_M file mixes Q4_K, Q6_K and F32), so
the scheme is chosen per projection at build, from the type of its tensor; every quantized
type maps exactly onto a Stoker method (quantization/gguf_blocks.py decodes them):

  F32, F16, BF16   float: the model dtype's method, as for a float checkpoint
  Q8_0             int8, one fp16 scale per 32 columns: `WeightScheme("int8", "group", 32)`
  Q6_K             int8 (6-bit values minus 32), one scale d * sc per 16 columns: group 16
  Q5_0             int8 (5-bit values minus 16), scale d per 32 columns (llama.cpp's fallback
                   for a Q4_K tensor whose rows are not whole 256-value super-blocks)
  Q5_K, Q5_1       affine int8 (layers/int8_affine_method.py): codes 0..31, a scale and an
                   offset per 32 columns (Q5_K: d * sc and -(dmin * m); Q5_1: d and m)
  Q4_0, Q4_1, Q4_K int4 (layers/int4_method.py), groups of 32: scale d, offset -8 d (Q4_0),
                   m (Q4_1), -(dmin * m) (Q4_K); the int4 method computes q * scale, rounded,
                   + offset, rounded, as gguf-py's dequantize does
  anything else    refused, naming the tensor and its type (no float fallback, which would
                   hide the weight bytes): Q2_K, Q3_K, the IQ types, TQ, MXFP4 ...

MoE experts (one 3-D tensor per projection, models/gguf_loader.py) run on Stoker's MoE methods,
decided per layer here from its expert tensors' types (`expert_scheme`, `expert_projections`):
float types on the float one; the symmetric int8 types throughout (Q8_0, Q6_K, Q5_0: int8 codes
and one scale per group of K per expert row, exactly the quantized MoE method's int8 groups,
layers/moe_quant.py) on the int8 one, at the layer's finest group; the 4-bit types throughout
(Q4_0, Q4_1, Q4_K: codes, a scale and an offset per 32 columns, as for a dense projection) on the
int4 one (layers/moe_int4.py, layout "gguf": the decoded codes, scales and offsets as they are).
A layer in neither, each projection held in its own type's codes (layers/moe_mixed.py: gate/up
and down each int4 or int8 codes with a scale and an offset per group, gate and up at their
finest group): a Q4_K_M or Q4_K_S file's "more bits" layers (Q4_K gate/up beside a Q6_K, Q5_K,
Q5_0 or Q8_0 down), and any layer with the affine 5-bit types (Q5_K, Q5_1: Q5_K_M's Q5_K gate/up
beside a Q5_K or Q6_K down). Refused by name (`expert_projections`): float experts beside
quantized ones, and gate and up in different families (one GEMM holds both; llama-quantize types
them alike).

A merged projection (q/k/v, gate/up) runs as one GEMM with one method when its shards share a
representation family: int8 shards of different group sizes run at the finest group (16 beside
32, the coarse scales repeated: exact), affine when any shard is (a symmetric shard's offsets
are 0); int4 shards at groups of 32. When the shards' families differ (a Q4_K_M file's Q4_K
q/k beside a Q6_K v, Q4_K_S's Q4_K q/k beside a Q5_K v, float beside quantized), the layer runs
one method per run of same-family shards (`shard_runs`; layers/composite_method.py).

The loader (models/gguf_loader.py) writes what this needs into the synthesized config.json's
`quantization_config`: {"quant_method": "gguf", "tensors": {hf module: [gguf tensor, type]}};
the runner reads it through `resolve` here rather than config.resolve.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from stoker.quantization.config import QuantConfig, QuantizationError, WeightScheme

FLOAT_TYPES = ("F32", "F16", "BF16")
INT8_GROUPS = {"Q8_0": 32, "Q6_K": 16, "Q5_0": 32, "Q5_K": 32, "Q5_1": 32}  # columns of K per scale
INT8_AFFINE = ("Q5_K", "Q5_1")  # with an offset per group
INT4_GROUPS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32}  # columns of K per scale and offset
SUPPORTED = "F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0"


def check_type(tensor: str, kind: str) -> None:
    """Refuse a tensor whose type has no exact Stoker method, by name."""
    if kind in FLOAT_TYPES or kind in INT8_GROUPS or kind in INT4_GROUPS:
        return
    raise QuantizationError(f"GGUF tensor {tensor} is {kind}, which has no exact Stoker method (a float fallback "
                            f"would hide the weight bytes); supported types: {SUPPORTED}")


def is_experts_tensor(tensor: str) -> bool:
    """A MoE layer's stacked experts (blk.N.ffn_{gate,up,down}_exps.weight; models/gguf_names.py)."""
    return tensor.startswith("blk.") and "_exps." in tensor


def _is_down(tensor: str) -> bool:
    return ".ffn_down_exps." in tensor


def expert_projections(tensors: list[tuple[str, str]]) -> tuple[WeightScheme, WeightScheme] | None:
    """A MoE layer's experts from their (gguf tensor, type)s: the (gate/up, down) schemes when the
    layer is held per projection (layers/moe_mixed.py: int4 with `int4_layout` "gguf", or int8
    with offsets, symmetric=False, a symmetric type's offsets 0), or None when one scheme holds it
    (`expert_scheme`). Refuses, naming the tensors, float experts beside quantized ones and gate
    and up of different families."""
    for tensor, kind in tensors:
        check_type(tensor, kind)
    named = ", ".join(f"{t} ({k})" for t, k in dict.fromkeys(tensors))
    families = {family(k) for _, k in tensors}
    if "float" in families and len(families) > 1:
        raise QuantizationError(f"GGUF tensors {named} are one Mixture-of-Experts layer's experts, float beside "
                                "quantized; Stoker's MoE methods hold a layer's experts all float or all quantized")
    w13 = [k for t, k in tensors if not _is_down(t)]
    down = [k for t, k in tensors if _is_down(t)]
    if len({family(k) for k in w13}) > 1:
        raise QuantizationError(f"GGUF tensors {named}: the experts' gate and up are in different representations "
                                f"({' and '.join(sorted({family(k) for k in w13}))}); Stoker runs them as one GEMM "
                                "in one representation")
    if len(families) == 1 and not any(k in INT8_AFFINE for _, k in tensors):
        return None  # one family, no offsets beside symmetric int8: one scheme (expert_scheme)
    return _held_with_offsets(common_scheme(w13)), _held_with_offsets(common_scheme(down))


def _held_with_offsets(scheme: WeightScheme | None) -> WeightScheme:
    assert scheme is not None
    if scheme.dtype == "int4":
        return dataclasses.replace(scheme, int4_layout="gguf")
    return dataclasses.replace(scheme, symmetric=False)


def expert_scheme(tensors: list[tuple[str, str]]) -> WeightScheme | None:
    """The one scheme a MoE layer's experts are held in, from their (gguf tensor, type)s:
    None (float), int8 at the finest group, or int4 groups of 32 with the decoded offsets
    (int4_layout "gguf", layers/moe_int4.py). A layer held per projection
    (`expert_projections`) has none: refused here, naming its tensors."""
    if expert_projections(tensors) is not None:
        named = ", ".join(f"{t} ({k})" for t, k in dict.fromkeys(tensors))
        raise QuantizationError(f"GGUF tensors {named} are held one scheme per projection (layers/moe_mixed.py, "
                                "expert_projections), not one scheme")
    scheme = common_scheme([k for _, k in tensors])
    if scheme is not None and scheme.dtype == "int4":
        scheme = dataclasses.replace(scheme, int4_layout="gguf")
    return scheme


def family(kind: str) -> str:
    """"float", "int4" or "int8": the representation a type is held in."""
    return "float" if kind in FLOAT_TYPES else "int4" if kind in INT4_GROUPS else "int8"


def _scheme(kind: str) -> WeightScheme | None:
    """A tensor type's scheme; None for float. int4 types hold explicit offsets
    (int4.AffineInt4); symmetric=False marks an int8 type with offsets (Q5_K, Q5_1)."""
    if kind in FLOAT_TYPES:
        return None
    if kind in INT4_GROUPS:
        return WeightScheme("int4", "group", group_size=INT4_GROUPS[kind], symmetric=kind == "Q4_0")
    return WeightScheme("int8", "group", group_size=INT8_GROUPS[kind], symmetric=kind not in INT8_AFFINE)


def common_scheme(kinds: list[str]) -> WeightScheme | None:
    """The one scheme that holds tensors of `kinds`, all of one family, exactly."""
    schemes = [_scheme(k) for k in kinds]
    if schemes[0] is None:
        return None
    assert all(s is not None and s.dtype == schemes[0].dtype for s in schemes)
    symmetric = all(s.symmetric for s in schemes if s is not None)
    finest = min(s.group_size or 0 for s in schemes if s is not None)  # 32 is a multiple of 16: exact
    return WeightScheme(schemes[0].dtype, "group", group_size=finest, symmetric=symmetric)


@dataclass(frozen=True)
class GGUFQuantConfig(QuantConfig):
    # (hf module name, gguf tensor name, type) per 2-D weight of the file
    tensors: tuple[tuple[str, str, str], ...] = ()

    @functools.cached_property
    def _by_module(self) -> dict[str, tuple[str, str]]:
        # a MoE file lists every expert's modules: thousands of names, looked up per expert
        return {m: (t, k) for m, t, k in self.tensors}

    def _types(self, module_names: list[str]) -> list[tuple[str, str]]:
        found = self._by_module
        missing = [m for m in module_names if m not in found]
        if missing:
            raise QuantizationError(f"the GGUF file has no weight for {', '.join(missing)}")
        return [found[m] for m in module_names]

    def is_ignored(self, module_name: str) -> bool:
        """A float tensor stays in the model dtype (the chooser's float method)."""
        return self._types([module_name])[0][1] in FLOAT_TYPES

    def shard_runs(self, module_names: list[str]) -> list[tuple[list[int], WeightScheme | None]]:
        """A merged projection's shards (their HF module names, in order) cut into runs of one
        representation family: [(shard indices, the run's common scheme; None: float)]."""
        types = self._types(module_names)
        runs: list[tuple[list[int], list[str]]] = []
        for i, (_, kind) in enumerate(types):
            if runs and family(runs[-1][1][-1]) == family(kind):
                runs[-1][0].append(i)
                runs[-1][1].append(kind)
            else:
                runs.append(([i], [kind]))
        return [(idx, common_scheme(kinds)) for idx, kinds in runs]

    def expert_projections(self, module_names: list[str]) -> tuple[WeightScheme, WeightScheme] | None:
        """A MoE layer's (gate/up, down) schemes when it is held per projection
        (layers/moe_mixed.py), given its experts' HF module names; None when one scheme holds it
        (weights_for) or the names are not a GGUF layer's experts."""
        types = self._types(module_names)
        if not all(is_experts_tensor(t) for t, _ in types):
            return None
        return expert_projections(list(dict.fromkeys(types)))

    def weights_for(self, module_names: list[str]) -> WeightScheme:
        types = self._types(module_names)
        if all(is_experts_tensor(t) for t, _ in types):  # a MoE layer's experts: expert_scheme's
            scheme = expert_scheme(list(dict.fromkeys(types)))
            if scheme is None:
                raise QuantizationError(f"GGUF tensors {', '.join(dict.fromkeys(t for t, _ in types))} are float experts: "
                                        "they hold no quantized scheme")
            return scheme
        runs = self.shard_runs(module_names)
        if len(runs) > 1 or runs[0][1] is None:
            types = self._types(module_names)
            raise QuantizationError("GGUF tensors " + ", ".join(f"{t} ({k})" for t, k in types) + " are of different "
                                    "representations: their merged projection runs one method per run of shards "
                                    "(layers/composite_method.py), not one scheme")
        scheme = runs[0][1]
        assert scheme is not None
        return scheme

    @property
    def quantizes_lm_head(self) -> bool:
        return not self.is_ignored("lm_head")

    @property
    def description(self) -> str:
        counts: dict[str, int] = {}
        for _, kind in set((t, k) for _, t, k in self.tensors):  # a MoE file's experts share one tensor
            counts[kind] = counts.get(kind, 0) + 1
        return "gguf (" + ", ".join(f"{n} x {k}" for k, n in sorted(counts.items())) + ")"


def resolve(hf_config: dict[str, Any], quantization: str | None) -> QuantConfig | None:
    """config.resolve for a GGUF file: its tensors' types (None when all are float); a
    --quantization flag is refused, since the file is already in its types."""
    if quantization is not None:
        raise QuantizationError(f"--quantization {quantization}: a GGUF file is already quantized tensor by tensor; "
                                "drop --quantization")
    qc = hf_config.get("quantization_config")
    return None if qc is None else gguf_quant_config(qc)


def gguf_quant_config(qc: dict[str, Any]) -> QuantConfig:
    tensors = qc.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise QuantizationError("a gguf quantization_config needs 'tensors': {module: [gguf tensor, type]}")
    rows = tuple((module, str(v[0]), str(v[1])) for module, v in sorted(tensors.items()))
    for _, tensor, kind in rows:
        check_type(tensor, kind)
    # `weights` is the scheme most projections have (for messages); each projection's own comes
    # from weights_for.
    quantized = [k for _, _, k in rows if k not in FLOAT_TYPES]
    common = max(set(quantized), key=quantized.count) if quantized else "Q8_0"
    scheme = _scheme(common)
    assert scheme is not None
    return GGUFQuantConfig(method="gguf", source="gguf", weights=scheme, tensors=rows)
