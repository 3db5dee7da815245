"""GGUF tensor types -> Stoker weight schemes, one per projection. [no torch]

A GGUF file stores each tensor in its own type (a Q4_K_M file mixes Q4_K, Q6_K and F32), so
the scheme is chosen per projection at build, from the type of its tensor:

  F32, F16, BF16   float: the model dtype's method, as for a float checkpoint
  Q8_0             int8, one fp16 scale per 32 columns: `WeightScheme("int8", "group", 32)`
  Q6_K             int8 (6-bit values minus 32), one scale d * sc per 16 columns: group 16
  Q4_0             int4 (layers/int4_method.py), groups of 32: scale d, offset -8 d
  Q4_K             int4, groups of 32: scale d * sc, offset -(dmin * m)
                   (quantization/gguf_blocks.py decodes both exactly to int4.AffineInt4; the
                   int4 method computes q * scale, rounded, + offset, rounded, as the decoder
                   and gguf-py's dequantize do)
  Q5_K             refused: 5-bit codes have no exact 4-bit or 8-bit method (no float
                   fallback, which would hide the weight bytes)
  anything else    refused, naming the tensor and its type

A merged projection (q/k/v, gate/up) runs as one GEMM with one method, so its shards must agree:
int8 shards of different group sizes (Q8_0 beside Q6_K) run at the finer group (16), each
coarse scale repeated, which is exact; Q4_0 beside Q4_K is one int4 group-32 method; a 4-bit
shard beside an 8-bit one (Q4_K q/k beside a Q6_K v, as Q4_K_M files have in some layers) and
float beside quantized shards are refused, naming the tensors.

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
INT4_GROUPS = {"Q4_0": 32, "Q4_K": 32}  # columns of K per scale and offset
AFFINE_TYPES = ("Q4_0", "Q4_K", "Q5_K")
SUPPORTED = "F32, F16, BF16, Q8_0, Q6_K, Q4_0, Q4_K"


def check_type(tensor: str, kind: str) -> None:
    """Refuse a tensor whose type has no exact Stoker method, by name."""
    if kind in FLOAT_TYPES or kind in INT8_GROUPS or kind in INT4_GROUPS:
        return
    if kind == "Q5_K":
        raise QuantizationError(
            f"GGUF tensor {tensor} is Q5_K: 5-bit codes have no exact Stoker method (a float fallback would hide "
            f"the weight bytes); use a file in {SUPPORTED}"
        )
    raise QuantizationError(f"GGUF tensor {tensor} is {kind}, which Stoker does not run; supported types: {SUPPORTED}")


def _scheme(kind: str) -> WeightScheme | None:
    """A tensor type's scheme; None for float. Q4_0's offset is -8 d (symmetric codes), Q4_K's
    its own minimum (asymmetric); both are held as explicit offsets (int4.AffineInt4)."""
    if kind in FLOAT_TYPES:
        return None
    if kind in INT4_GROUPS:
        return WeightScheme("int4", "group", group_size=INT4_GROUPS[kind], symmetric=kind == "Q4_0")
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
        quantized = [s for s in schemes if s is not None]
        if len({s.dtype for s in quantized}) > 1:
            raise QuantizationError(
                "GGUF tensors " + ", ".join(f"{t} ({k})" for t, k in types) + " make one merged projection in Stoker "
                "(one GEMM, one method), and 4-bit beside 8-bit shards have no exact common method (a Q4_K_M file "
                "mixes Q4_K with Q6_K this way); use a file whose merged shards are all 4-bit or all 8-bit"
            )
        if quantized[0].dtype == "int4":  # Q4_0 and Q4_K: both groups of 32 with explicit offsets
            return WeightScheme("int4", "group", group_size=32, symmetric=all(s.symmetric for s in quantized))
        finest = min(s.group_size or 0 for s in quantized)  # 32 is a multiple of 16: exact
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
    quantized = [k for _, _, k in rows if k not in FLOAT_TYPES]
    common = max(set(quantized), key=quantized.count) if quantized else "Q8_0"
    scheme = _scheme(common)
    assert scheme is not None
    return GGUFQuantConfig(method="gguf", source="gguf", weights=scheme, tensors=rows)
