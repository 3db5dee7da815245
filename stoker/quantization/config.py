"""What quantization a model runs with, read once from `--quantization` and config.json. [no torch]

Two sources, one result (`QuantConfig`):
  * online: `--quantization fp8|int8` (vLLM's flag) on a float checkpoint: every decoder-layer
    projection is quantized at load, symmetric, one scale per output channel; embeddings and the
    LM head stay in the model dtype. `--quantization int4` is Stoker's own (vLLM has no online
    4-bit flag): symmetric 4-bit, round-to-nearest, one scale per group of 128 columns.
  * a pre-quantized checkpoint, from config.json's `quantization_config`:
      - compressed-tensors (what llm-compressor writes), formats "float-quantized" (FP8 E4M3),
        "int-quantized" (int8) and "pack-quantized" (int8 packed four to an int32), weight
        strategies tensor / channel / group / block, symmetric; the `ignore` list; a
        `kv_cache_scheme` (FP8 KV with per-layer k/v scales); and 4-bit "pack-quantized"
        (W4A16: eight values to an int32, group or channel scales, symmetric or with packed
        zero points; `_compressed_tensors_w4a16`);
      - `"quant_method": "fp8"` (vLLM / Qwen3-FP8 / DeepSeek): FP8 weights with a per-tensor
        `weight_scale`, or `weight_block_size` [128, 128] blocks with `weight_scale_inv`;
      - `"quant_method": "mxfp4"` (gpt-oss): the MoE experts as MXFP4 `*_blocks` / `*_scales`
        (layers/moe_mxfp4.py), everything else in the model dtype.
      - `"quant_method": "gptq"` / `"awq"` 4-bit (`_gptq_awq`): `qweight`, `qzeros`, `scales`
        (and GPTQ's `g_idx`, which must be the plain group order).
Anything else is refused here, naming what it found and listing what is supported, before a
single tensor is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ONLINE_METHODS = ("fp8", "int8", "int4")
INT4_ONLINE_GROUP_SIZE = 128  # --quantization int4's group of columns per scale
SUPPORTED_CHECKPOINTS = (
    "compressed-tensors (float-quantized, int-quantized, pack-quantized; 8-bit, symmetric; "
    "4-bit pack-quantized W4A16, group or channel, symmetric or asymmetric)",
    "fp8 (per-tensor weight_scale or weight_block_size [128, 128] with weight_scale_inv)",
    "mxfp4 (gpt-oss: Mixture-of-Experts experts as *_blocks / *_scales)",
    "gptq (4-bit, sym or asym, g_idx in group order)", "awq (4-bit GEMM with zero points)",
)
_STRATEGIES = ("tensor", "channel", "group", "block")
WEIGHT_DTYPES = ("fp8", "int8", "int4", "mxfp4")  # mxfp4: E2M1 values, an E8M0 scale per group of 32 (experts only)


class QuantizationError(ValueError):
    """A quantization flag or checkpoint config the engine cannot honour; the message says what to change."""


@dataclass(frozen=True)
class WeightScheme:
    """How one projection's weight is stored. Scales are per output channel and group of K."""

    dtype: str  # "fp8" (E4M3) | "int8" | "int4" (affine groups: quantization/int4.py)
    strategy: str  # "tensor" | "channel" | "group" | "block"
    group_size: int | None = None  # group: columns of K per scale
    block: tuple[int, int] | None = None  # block: (rows of N, columns of K) per scale
    packed: bool = False  # int8 values packed four to an int32 (compressed-tensors pack-quantized)
    dynamic_activations: bool = False  # W8A8 with per-token activation scales (FP8 only)
    static_input_scale: bool = False  # the checkpoint carries input_scale (W8A8 static)
    symmetric: bool = True  # int4: False when the checkpoint carries zero points
    int4_layout: str = ""  # int4 checkpoint tensors: "compressed-tensors", "gptq", "gptq_v2", "awq", "gguf" (MoE experts); "" online

    @property
    def quantized_activations(self) -> bool:
        """The scheme asks for 8-bit activations too (W8A8); otherwise it is weight-only (W8A16)."""
        return self.dynamic_activations or self.static_input_scale

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise QuantizationError(f"weight dtype {self.dtype!r}: supported are {', '.join(WEIGHT_DTYPES)}")
        if self.dtype == "int4" and self.strategy not in ("group", "channel"):
            raise QuantizationError(f"int4 weights have scales per group or channel (one group of K), not {self.strategy!r}")
        if self.strategy not in _STRATEGIES:
            raise QuantizationError(f"weight strategy {self.strategy!r}: supported are {', '.join(_STRATEGIES)}")
        if self.strategy == "group" and not (self.group_size and self.group_size > 0):
            raise QuantizationError("weight strategy 'group' needs a positive group_size")
        if self.strategy == "block" and not (self.block and all(b > 0 for b in self.block)):
            raise QuantizationError("weight strategy 'block' needs a block structure [rows, columns]")

    @property
    def scale_name(self) -> str:
        """The checkpoint tensor holding the weight scales."""
        return "weight_scale_inv" if self.strategy == "block" else "weight_scale"

    @property
    def weight_name(self) -> str:
        return "weight_packed" if self.packed else "weight"


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8" | "int8" | "int4": what --quantization would be called for this scheme
    source: str  # "online" | "compressed-tensors" | "fp8" | "gptq" | "awq"
    weights: WeightScheme
    ignore: tuple[str, ...] = ()  # module names (or "re:<regex>") left in the model dtype
    kv_cache_fp8: bool = False  # the checkpoint's scheme quantizes the KV cache to FP8
    # --activation-dtype: "int8" runs the int4 projections as W4A8 (layers/int4_method.py)
    activation_dtype: str = "auto"

    @property
    def online(self) -> bool:
        return self.source == "online"

    @property
    def experts_only(self) -> bool:
        """The scheme covers only Mixture-of-Experts experts (mxfp4: the rest is in the model dtype)."""
        return self.source == "mxfp4"

    @property
    def description(self) -> str:
        w = self.weights
        detail = w.strategy + (f" {w.group_size}" if w.group_size else "") + (f" {w.block[0]}x{w.block[1]}" if w.block else "")
        return f"{self.method} ({self.source}, per-{detail} scales)"

    def weights_for(self, module_names: list[str]) -> WeightScheme:
        """The scheme of one projection, given its checkpoint modules (a merged projection's
        shards): the checkpoint's one scheme here; a GGUF file's differs per tensor
        (quantization/gguf.py)."""
        return self.weights

    @property
    def quantizes_lm_head(self) -> bool:
        """Whether the LM head is quantized too (only a GGUF file's can be)."""
        return False

    def is_ignored(self, module_name: str) -> bool:
        """True if the checkpoint module `module_name` (e.g. model.layers.0.mlp.down_proj) stays unquantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):  # compressed-tensors' convention: re.match on the name
                if re.match(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False


def online_config(method: str) -> QuantConfig:
    if method not in ONLINE_METHODS:
        raise QuantizationError(f"--quantization {method!r} is not supported; choose one of: {', '.join(ONLINE_METHODS)}")
    if method == "int4":  # W4A16, round-to-nearest, symmetric (offset = -8 x scale)
        weights = WeightScheme("int4", "group", group_size=INT4_ONLINE_GROUP_SIZE)
        return QuantConfig(method="int4", source="online", weights=weights, ignore=("lm_head",))
    # Online FP8 is W8A8 with per-token activation scales where FP8 matrix units exist (as
    # vLLM's); online INT8 is weight-only.
    weights = WeightScheme(dtype=method, strategy="channel", dynamic_activations=method == "fp8")
    return QuantConfig(method=method, source="online", weights=weights, ignore=("lm_head",))


def resolve(hf_config: dict[str, Any], quantization: str | None) -> QuantConfig | None:
    """The scheme the engine runs: from the checkpoint if it is quantized (then `quantization`,
    if given, must agree), else from `quantization` (online), else None (float weights)."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return online_config(quantization) if quantization else None
    found = parse_checkpoint_config(qc)
    if quantization is not None and quantization != found.method:
        raise QuantizationError(
            f"--quantization {quantization} disagrees with the checkpoint, which is already quantized as "
            f"{found.description}; drop --quantization (or pass --quantization {found.method})"
        )
    return found


def parse_checkpoint_config(qc: dict[str, Any]) -> QuantConfig:
    if not isinstance(qc, dict):
        raise QuantizationError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8_checkpoint(qc)
    if method == "mxfp4":
        return _mxfp4_checkpoint(qc)
    if method in ("gptq", "awq"):
        return _gptq_awq(qc, method)
    raise QuantizationError(
        f"quantization_config quant_method {method!r} is not supported; supported: {'; '.join(SUPPORTED_CHECKPOINTS)}"
    )


def _fp8_checkpoint(qc: dict[str, Any]) -> QuantConfig:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8 checkpoint fmt {fmt!r} is not supported; only e4m3")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"fp8 activation_scheme {scheme!r} is not supported; dynamic or static")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationError(f"fp8 weight_block_size must be [rows, columns], got {block!r}")
        weights = WeightScheme("fp8", "block", block=(block[0], block[1]), dynamic_activations=scheme == "dynamic")
    else:
        weights = WeightScheme("fp8", "tensor", dynamic_activations=scheme == "dynamic", static_input_scale=scheme == "static")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()) + ("lm_head",)
    return QuantConfig(method="fp8", source="fp8", weights=weights, ignore=ignore)


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(
            f"compressed-tensors checkpoints with {len(groups)} config_groups are not supported; one group "
            "(the same scheme for every quantized Linear) is"
        )
    group = next(iter(groups.values()))
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise QuantizationError(f"compressed-tensors targets {targets!r} are not supported; only ['Linear']")
    fmt = group.get("format") or qc.get("format")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise QuantizationError("compressed-tensors config group has no 'weights' scheme (weight quantization is required)")
    num_bits, wtype = w.get("num_bits"), w.get("type", "int")
    if num_bits == 4 and wtype == "int":
        return _compressed_tensors_w4a16(qc, group, w, fmt)
    if num_bits != 8:
        raise QuantizationError(f"compressed-tensors weights of {num_bits} bits are not supported; only 8-bit (fp8 or int8)")
    if not w.get("symmetric", True):
        raise QuantizationError("compressed-tensors asymmetric weights (zero points) are not supported; only symmetric")
    if w.get("actorder") not in (None, False, "static", "weight"):
        # "group" stores a column permutation (weight_g_idx) the kernels do not apply
        raise QuantizationError(f"compressed-tensors actorder {w.get('actorder')!r} is not supported; none, static or weight")
    dtype = {"float": "fp8", "int": "int8"}.get(wtype)
    if dtype is None:
        raise QuantizationError(f"compressed-tensors weight type {wtype!r} is not supported; float (fp8) or int (int8)")
    expected_formats = {"fp8": ("float-quantized", "naive-quantized"), "int8": ("int-quantized", "pack-quantized", "naive-quantized")}
    if fmt not in expected_formats[dtype]:
        raise QuantizationError(
            f"compressed-tensors format {fmt!r} for {wtype} weights is not supported; supported: "
            f"{', '.join(expected_formats[dtype])}"
        )
    strategy = w.get("strategy", "tensor")
    block = w.get("block_structure")
    if strategy == "block":
        if isinstance(block, str):  # older files write "128x128"
            block = [int(b) for b in block.lower().split("x")]
        if not (isinstance(block, list) and len(block) == 2):
            raise QuantizationError(f"compressed-tensors block strategy needs block_structure [rows, columns], got {block!r}")
    if strategy not in _STRATEGIES:
        raise QuantizationError(f"compressed-tensors weight strategy {strategy!r} is not supported; supported: {', '.join(_STRATEGIES)}")
    acts = group.get("input_activations")
    dynamic = static = False
    if acts:
        if acts.get("num_bits") != 8 or acts.get("type", "int") != wtype or acts.get("strategy", "tensor") not in ("token", "tensor"):
            raise QuantizationError(
                f"compressed-tensors input_activations {acts!r} are not supported with {wtype} weights; "
                "8-bit, the weights' type, per token or per tensor"
            )
        dynamic = bool(acts.get("dynamic", False))
        static = not dynamic
    if group.get("output_activations"):
        raise QuantizationError("compressed-tensors output_activations quantization is not supported")
    weights = WeightScheme(
        dtype, strategy, group_size=w.get("group_size") if strategy == "group" else None,
        block=tuple(block) if strategy == "block" else None, packed=fmt == "pack-quantized",
        dynamic_activations=dynamic and dtype == "fp8", static_input_scale=static,
    )  # fmt: skip
    kv = qc.get("kv_cache_scheme")
    if kv:
        if kv.get("num_bits") != 8 or kv.get("type") != "float" or kv.get("strategy", "tensor") != "tensor":
            raise QuantizationError(f"compressed-tensors kv_cache_scheme {kv!r} is not supported; 8-bit float per tensor")
    return QuantConfig(method=dtype, source="compressed-tensors", weights=weights, ignore=tuple(qc.get("ignore") or ()),
                       kv_cache_fp8=bool(kv))


# Mxfp4Config's keys (transformers): what the Hub's gpt-oss configs carry; `dequantize` asks
# transformers to expand the experts at load, which the engine does not need (it runs them 4-bit).
_MXFP4_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


def _mxfp4_checkpoint(qc: dict[str, Any]) -> QuantConfig:
    """gpt-oss's MXFP4: only the experts are quantized; modules_to_not_convert names the rest
    (attention, router, embeddings, LM head), which the engine keeps in the model dtype anyway."""
    unknown = sorted(set(qc) - _MXFP4_KEYS)
    if unknown:
        raise QuantizationError(f"mxfp4 quantization_config fields {unknown} are not supported; known: "
                                f"{', '.join(sorted(_MXFP4_KEYS))}")
    ignore = qc.get("modules_to_not_convert") or []
    if not isinstance(ignore, list):
        raise QuantizationError(f"mxfp4 modules_to_not_convert must be a list, got {ignore!r}")
    weights = WeightScheme("mxfp4", "group", group_size=32)
    return QuantConfig(method="mxfp4", source="mxfp4", weights=weights, ignore=tuple(ignore))


def _compressed_tensors_w4a16(qc: dict[str, Any], group: dict[str, Any], w: dict[str, Any], fmt: Any) -> QuantConfig:
    """compressed-tensors 4-bit integer weights (llm-compressor's W4A16): format
    "pack-quantized" (eight 4-bit values to an int32 `weight_packed`, `weight_scale` per group
    or channel, `weight_zero_point` packed eight rows to an int32 when asymmetric), activations
    in the model dtype. Mapped onto the int4 method's affine groups (a channel is one group of K)."""
    if fmt != "pack-quantized":
        raise QuantizationError(f"compressed-tensors format {fmt!r} for 4-bit int weights is not supported; only pack-quantized")
    strategy = w.get("strategy", "tensor")
    if strategy not in ("group", "channel"):
        raise QuantizationError(f"compressed-tensors 4-bit weight strategy {strategy!r} is not supported; group or channel")
    if w.get("actorder") not in (None, False, "static", "weight"):
        raise QuantizationError(f"compressed-tensors actorder {w.get('actorder')!r} is not supported (its weight_g_idx "
                                "permutes the groups); none, static or weight")
    if group.get("input_activations"):
        raise QuantizationError("compressed-tensors 4-bit weights with quantized input_activations (W4A8) are not "
                                "supported; only W4A16 (no input_activations)")
    if group.get("output_activations"):
        raise QuantizationError("compressed-tensors output_activations quantization is not supported")
    if qc.get("kv_cache_scheme"):
        raise QuantizationError("compressed-tensors kv_cache_scheme with 4-bit weights is not supported")
    size = w.get("group_size")
    if strategy == "group" and not (isinstance(size, int) and size > 0):
        raise QuantizationError(f"compressed-tensors group strategy needs a positive group_size, got {size!r}")
    # channel: one group spanning K (the method takes K from the layer)
    weights = WeightScheme("int4", strategy, group_size=size if strategy == "group" else None, packed=True,
                           symmetric=bool(w.get("symmetric", True)), int4_layout="compressed-tensors")
    return QuantConfig(method="int4", source="compressed-tensors", weights=weights, ignore=tuple(qc.get("ignore") or ()))


def _gptq_awq(qc: dict[str, Any], method: str) -> QuantConfig:
    """GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ GEMM) 4-bit checkpoints, mapped onto the
    int4 method's affine groups: `qweight` int32 (GPTQ: (K / 8, N), eight rows of K per value;
    AWQ: (K, N / 8), eight columns in the order 0 2 4 6 1 3 5 7), `qzeros` (G, N / 8) int32 in
    the same column order, `scales` (G, N); GPTQ's zeros are stored minus one (checkpoint_format
    "gptq"; "gptq_v2" stores them as they are) and its `g_idx` (K,) must be plain group order."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantizationError(f"{method} checkpoints of {bits} bits are not supported; only 4-bit")
    size = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(size, int) or size == 0 or size < -1:
        raise QuantizationError(f"{method} group_size {size!r} is not supported; a positive size, or -1 (per channel)")
    strategy = "channel" if size == -1 else "group"
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizationError(f"gptq checkpoint_format {fmt!r} is not supported; gptq or gptq_v2")
        # desc_act (act-order) checkpoints are read when their g_idx is plain group order (the
        # loader checks it, naming desc_act); a permuted g_idx is refused there.
        symmetric, layout = bool(qc.get("sym", True)), fmt
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"awq version {version!r} is not supported; only gemm (AutoAWQ's default packing)")
        if not qc.get("zero_point", True):
            raise QuantizationError("awq zero_point false is not supported; only AutoAWQ's default (zero points)")
        symmetric, layout = False, "awq"
    weights = WeightScheme("int4", strategy, group_size=size if strategy == "group" else None, symmetric=symmetric,
                           int4_layout=layout)
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return QuantConfig(method="int4", source=method, weights=weights, ignore=ignore)
