"""GGUF tensor types -> Stoker weight schemes, one per projection. [no torch]

A GGUF file stores each tensor in its own type (a Q4_K_M file mixes Q4_K, Q6_K and F32), so
the scheme is chosen per projection at build, from the type of its tensor:

  F32, F16, BF16   float: the model dtype's method, as for a float checkpoint
  Q8_0             int8, one fp16 scale per 32 columns: `WeightScheme("int8", "group", 32)`
  Q6_K             int8 (6-bit values minus 32), one scale d * sc per 16 columns: group 16
  Q4_0, Q4_K, Q5_K 4-bit / 5-bit affine groups of 32 (quantization/gguf_blocks.py decodes
                   them exactly); refused until Stoker has a 4-bit method: no float fallback
                   (it would hide 4x the weight bytes)
  anything else    refused, naming the tensor and its type

A merged projection (q/k/v, gate/up) runs as one GEMM with one method, so its shards must agree:
int8 shards of different group sizes (Q8_0 beside Q6_K) run at the finer group (16), each
coarse scale repeated, which is exact; float beside quantized shards is refused, naming both.

The loader (models/gguf_loader.py) writes what this needs into the synthesized config.json's
`quantization_config`: {"quant_method": "gguf", "tensors": {hf module: [gguf tensor, type]}};
the runner reads it through `resolve` here rather than config.resolve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.quantization.config import QuantConfig, QuantizationError, WeightScheme

FLOAT_TYPES = ("F32", "F16", "BF16")
INT8_GROUPS = {"Q8_0": 32, "Q6_K": 16}  # columns of K per scale
AFFINE_TYPES = ("Q4_0", "Q4_K", "Q5_K")
SUPPORTED = "F32, F16, BF16, Q8_0, Q6_K"


def check_type(tensor: str, kind: str) -> None:
    """Refuse a tensor whose type has no exact Stoker method, by name."""
    if kind in FLOAT_TYPES or kind in INT8_GROUPS:
        return
    if kind in AFFINE_TYPES:
        raise QuantizationError(
            f"GGUF tensor {tensor} is {kind}: 4-bit weights need Stoker's int4 method, which this build does not "
            f"have (a float fallback would hide 4x the bytes); use a Q8_0 or Q6_K file ({SUPPORTED} are supported)"
        )
    raise QuantizationError(f"GGUF tensor {tensor} is {kind}, which Stoker does not run; supported types: {SUPPORTED}")


def _scheme(kind: str) -> WeightScheme | None:
    """A tensor type's scheme; None for float."""
    if kind in FLOAT_TYPES:
        return None
    return WeightScheme("int8", "group", group_size=INT8_GROUPS[kind])


@dataclass(frozen=True)
class GGUFQuantConfig(QuantConfig):
    # (hf module name, gguf tensor name, type) per 2-D weight of the file
    tensors: tuple[tuple[str, str, str], ...] = ()

    def _types(self, module_names: list[str]) -> list[tuple[str, str]]:
        found = {m: (t, k) for m, t, k in self.tensors}
        missing = [m for m in module_names if m not in found]
        if missing:
            raise QuantizationError(f"the GGUF file has no weight for {', '.join(missing)}")
        return [found[m] for m in module_names]

    def is_ignored(self, module_name: str) -> bool:
        """A float tensor stays in the model dtype (the chooser's float method)."""
        return self._types([module_name])[0][1] in FLOAT_TYPES

    def weights_for(self, module_names: list[str]) -> WeightScheme:
        types = self._types(module_names)
        schemes = [_scheme(k) for _, k in types]
        if any(s is None for s in schemes):
            raise QuantizationError(
                "GGUF tensors " + ", ".join(f"{t} ({k})" for t, k in types) + " make one merged projection in Stoker "
                "(one GEMM, one method), and float beside quantized shards has no exact common method"
            )
        finest = min(s.group_size or 0 for s in schemes if s is not None)  # 32 is a multiple of 16: exact
        return WeightScheme("int8", "group", group_size=finest)

    @property
    def quantizes_lm_head(self) -> bool:
        return not self.is_ignored("lm_head")

    @property
    def description(self) -> str:
        counts: dict[str, int] = {}
        for _, _, kind in self.tensors:
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
    quantized = [k for _, _, k in rows if k in INT8_GROUPS]
    common = max(set(quantized), key=quantized.count) if quantized else "Q8_0"
    return GGUFQuantConfig(method="gguf", source="gguf", weights=WeightScheme("int8", "group", group_size=INT8_GROUPS[common]),
                           tensors=rows)
