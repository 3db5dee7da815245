"""Load a Hugging Face checkpoint directory: config.json + safetensors (single or sharded), or a
GGUF file (models/gguf_loader.py: its config synthesized, its tensors read under HF names).

Every tensor in the checkpoint must land in a parameter of the right shape and every
parameter must be filled; anything else is an error that names the tensor.

With tensor parallelism each rank reads only its part of each tensor (safetensors'
`get_slice` reads those bytes of the memory-mapped file), as its layers and their weight
methods say (`checkpoint_slice`): no rank holds the whole model in memory at any time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.embedding import VocabEmbedding
from stoker.layers.linear import Linear
from stoker.layers.moe import FusedMoE
from stoker.layers.rotary import rope_parameters
from stoker.models import moe_loading
from stoker.models.gguf_loader import GGUFTensors, is_gguf_file, read_gguf_config
from stoker.models.packed import checkpoint_module_name
from stoker.models.registry import get_model_class
from stoker.quantization.config import QuantConfig

logger = logging.getLogger(__name__)

# Present in some checkpoints, recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    if is_gguf_file(model_dir):  # a llama.cpp file: its config.json synthesized from the metadata
        cfg = read_gguf_config(model_dir)
        rope_parameters(cfg)
        return cfg
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist; pass a Hugging Face checkpoint folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: a checkpoint folder needs config.json")
    cfg = json.loads(config_file.read_text())
    # A multimodal checkpoint served by its language model reads that model's config (Gemma 3: text_config)
    model_config = getattr(get_model_class(cfg.get("architectures")), "model_config", None)
    if model_config is not None:
        cfg = model_config(cfg)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if key not in cfg:
            raise ValueError(f"{config_file} has no {key!r}, which the model needs")
    get_model_class(cfg.get("architectures"))  # fail fast, before anything else reads the folder
    rope_parameters(cfg)
    return cfg


def safetensors_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported)")
    return files


def build_model(
    hf_config: dict[str, Any],
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig | None = None,
    tp: TensorParallelGroup | None = None,
) -> nn.Module:
    """The model (this rank's shard of it under tensor parallelism) with every projection's
    weight method chosen (models/method_chooser.py) and its parameters created, uninitialised, on
    `device`."""
    model_cls = get_model_class(hf_config.get("architectures"))
    return build_with_methods(lambda: model_cls(hf_config, max_position, tp), dtype, device, quant)


def build_with_methods(make: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device,
                       quant: QuantConfig | None = None, what: str = "projections") -> nn.Module:
    """`make()` run with `dtype` and `device` as torch's defaults, then every Linear given its
    weight method (which creates its parameters); logs the methods chosen as "`what`: ..."."""
    from stoker.models.method_chooser import LinearMethodChooser, bind_kernels

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = make()
            chooser = LinearMethodChooser(quant, device, dtype, model)
            for name, module in list(model.named_modules()):
                if isinstance(module, Linear):
                    module.attach(chooser(name, module))
                elif isinstance(module, FusedMoE):
                    module.attach(chooser.moe(name, module))
    finally:
        torch.set_default_dtype(previous)
    kernels = bind_kernels(model, device, dtype)
    logger.info("%s: %s; attention, norms and rotary: %s kernels", what, chooser.summary(), kernels)
    return model.eval().requires_grad_(False)


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Read every safetensors tensor into its parameter, through each projection's weight
    method; then check that every expected tensor came, naming the missing ones as the
    checkpoint would, and let each method re-lay its weights for its backend."""
    params = dict(model.named_parameters(remove_duplicate=False))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    embeddings = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, VocabEmbedding)}
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    # checkpoint modules stored already stacked, as the merged layer holds them (Phi-3's qkv_proj)
    fused: dict[str, tuple[str, ...]] = getattr(model, "fused_checkpoint_modules", {})
    moes = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    expert_params: dict[str, str] = getattr(model, "expert_params", {})
    # a family whose checkpoint stacks its experts its own way (gpt-oss) reads them itself
    load_experts = getattr(model, "load_expert_tensor", moe_loading.load_expert_tensor)
    expert_name = getattr(model, "expert_checkpoint_name", moe_loading.checkpoint_name)
    tied = bool(model.config.get("tie_word_embeddings", False))
    # A family's tensors it does not run (GLM-4.5's multi-token-prediction layer, a vision tower)
    skip: Callable[[str], bool] = getattr(model, "skips_checkpoint_tensor", lambda name: False)
    # A family whose checkpoint names its tensors under another prefix (a multimodal model's language model)
    rename: Callable[[str], str] | None = getattr(model, "checkpoint_name", None)
    filled: set[str] = set()
    for file in [Path(model_dir)] if is_gguf_file(model_dir) else safetensors_files(model_dir):
        with GGUFTensors(file, model) if is_gguf_file(file) else safe_open(str(file), framework="pt", device="cpu") as raw:
            f = raw if rename is None else _RenamedTensors(raw, rename, skip)
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight") or skip(name):
                    continue
                if name.endswith(_KV_SCALE_SUFFIXES):
                    _load_kv_scale(model, name, f.get_tensor(name))
                    continue
                experts = load_experts(moes, expert_params, name, f) if moes else None
                if experts is not None:
                    filled.update(experts)
                    continue
                fused_into = _fused_shards(linears, fused, name)
                if fused_into is not None:
                    filled.update(_load_fused(fused_into, name, f))
                    continue
                filled.add(_load_one(params, linears, embeddings, packed, name, f))
            if isinstance(raw, GGUFTensors):  # Q4_0 / Q4_K tensors, decoded whole to the int4 method's affine form
                filled.update(raw.load_affine_weights(linears, packed))
    expected = {n for n in params if not any(n.startswith(prefix + ".") for prefix in (*linears, *moes))}
    expected.update(f"{name}.{p}" for name, layer in linears.items() for p in getattr(layer, "extra_params", ()))
    for module_name, moe in moes.items():
        expected.update(moe_loading.expected_keys(module_name, moe))
    for module_name, layer in linears.items():
        assert layer.method is not None
        names = layer.method.checkpoint_params(layer) + (("bias",) if layer.has_bias else ())
        # a merged layer whose shards are stored differently names each shard's own (composite_method.py)
        of_shard = getattr(layer.method, "shard_checkpoint_params", None)
        for shard in list(layer.shard_offsets) or [None]:
            own = names if of_shard is None else of_shard(layer, shard) + (("bias",) if layer.has_bias else ())
            expected.update(f"{module_name}.{p}#{shard}" for p in own)
    missing = sorted(expected - filled)
    if missing:
        named = []
        for key in missing[:10]:
            if key.partition("#")[0] in moes:
                named.append(expert_name(key, expert_params))
                continue
            base, _, shard = key.partition("#")
            module_name, _, param = base.rpartition(".")
            named.append(f"{checkpoint_module_name(model, module_name, shard or None)}.{param}" if base.rpartition(".")[0] in linears else base)
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(named)}" + (" ..." if len(missing) > 10 else ""))
    for layer in linears.values():
        assert layer.method is not None
        layer.method.process_after_loading(layer)
    for moe in moes.values():
        assert moe.method is not None
        moe.method.process_after_loading(moe)


class _RenamedTensors:
    """A safetensors file whose tensors are seen under the model's names (`rename`), the skipped
    ones left out; reads go to the file's own names."""

    def __init__(self, f: Any, rename: Callable[[str], str], skip: Callable[[str], bool]) -> None:
        self.f = f
        self.names = {rename(n): n for n in f.keys() if not skip(n)}

    def keys(self) -> list[str]:
        return list(self.names)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(self.names[name])

    def get_slice(self, name: str) -> Any:
        return self.f.get_slice(self.names[name])


def _shape(f: Any, name: str) -> tuple[int, ...]:
    """A checkpoint tensor's shape, read from the header (no data)."""
    return tuple(f.get_slice(name).get_shape())


def _read(f: Any, name: str, part: tuple[slice, ...] | None) -> torch.Tensor:
    """The whole tensor, or only `part` of it (a tensor-parallel rank's rows / columns)."""
    return f.get_tensor(name) if part is None else f.get_slice(name)[part]


def _load_one(
    params: dict[str, nn.Parameter],
    linears: dict[str, Linear],
    embeddings: dict[str, VocabEmbedding],
    packed: dict[str, tuple[str, str]],
    name: str,
    f: Any,
) -> str:
    """Put one checkpoint tensor (this rank's part of it) where it belongs; returns its key in
    the expected set."""
    module_name, _, param_name = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    shard = None
    if leaf in packed:
        merged, shard = packed[leaf]
        module_name = f"{parent}.{merged}" if parent else merged
    layer = linears.get(module_name)
    if layer is not None and param_name in getattr(layer, "extra_params", ()):
        layer = None  # a plain parameter beside the method's (a router's correction bias): read verbatim below
    if layer is not None:
        assert layer.method is not None
        try:
            tensor = _read(f, name, layer.method.checkpoint_slice(layer, param_name, shard, _shape(f, name)))
            if param_name == "bias" and layer.reduce is not None and not layer.reduce.is_first:
                tensor = torch.zeros_like(tensor)  # a row-parallel bias is added once, by rank 0's partial sum
            layer.method.load(layer, param_name, shard, tensor)
        except ValueError as exc:  # the method knows what is wrong, the loader which tensor
            raise ValueError(f"{exc} (checkpoint tensor {name})") from None
        return f"{module_name}.{param_name}#{shard}"
    if name in embeddings:
        try:
            embeddings[name].load(_read(f, name, embeddings[name].checkpoint_slice(_shape(f, name))))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return name
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
    param = params[name]
    # a plain parameter cut over tensor-parallel ranks says which part it reads (gpt-oss's sinks)
    part = getattr(param, "checkpoint_slice", None)
    tensor = f.get_tensor(name) if part is None else f.get_slice(name)[part]
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return name


def _fused_shards(linears: dict[str, Linear], fused: dict[str, tuple[str, ...]], name: str) -> tuple[Linear, str] | None:
    """(the merged layer, its module name) when `name` is a tensor of a checkpoint module that
    stacks the layer's shards itself (model.layers.0.self_attn.qkv_proj.weight: q, k, v rows)."""
    module_name = name.rpartition(".")[0]
    if module_name.rpartition(".")[2] not in fused or module_name not in linears:
        return None
    return linears[module_name], module_name


class _ShardRows:
    """One shard's rows of a stacked checkpoint tensor, read as if it were the shard's own
    tensor: the weight method asks for its part (`checkpoint_slice`) of a (rows, ...) tensor and
    gets those rows of the stacked one, so a tensor-parallel rank still reads only its bytes
    (its q rows, its k rows, its v rows, each cut over the ranks on its own)."""

    def __init__(self, f: Any, name: str, first: int, rows: int | None) -> None:
        self.f, self.name, self.first, self.rows = f, name, first, rows

    def get_slice(self, name: str) -> _ShardRows:
        return self

    def get_shape(self) -> list[int]:
        shape = list(self.f.get_slice(self.name).get_shape())
        return shape if self.rows is None else [self.rows, *shape[1:]]

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(self.name) if self.rows is None else self[(slice(None),)]

    def __getitem__(self, part: tuple[slice, ...]) -> torch.Tensor:
        if self.rows is None:  # a per-tensor value (a scale): the same for every shard
            return self.f.get_slice(self.name)[part]
        rows, *rest = part
        start, stop, _ = rows.indices(self.rows)
        return self.f.get_slice(self.name)[(slice(self.first + start, self.first + stop), *rest)]


def _load_fused(target: tuple[Linear, str], name: str, f: Any) -> list[str]:
    """Load a stacked checkpoint tensor (rows [shard 0; shard 1; ...] in the layer's shard
    order, each shard's whole rows) into the merged layer's shards; returns their keys. A tensor
    with one row per output row is cut at the shards' boundaries; a per-tensor one (a scalar
    scale) is given whole to every shard; any other shape is refused by name."""
    layer, module_name = target
    param_name = name.rpartition(".")[2]
    shape = tuple(f.get_slice(name).get_shape())
    total = sum(rows for rows, _ in layer.checkpoint_shards.values())
    per_tensor = len(shape) == 0 or shape == (1,)
    if param_name == "weight_shape":  # compressed-tensors' [rows, in] of the whole stacked tensor: each shard's own
        whole = [int(v) for v in f.get_tensor(name).reshape(-1).tolist()]
        if whole != [total, layer.checkpoint_in_features]:
            raise ValueError(f"checkpoint tensor {name} says {whole}; the stacked layer is {[total, layer.checkpoint_in_features]}")
        assert layer.method is not None
        for shard, (rows, _) in layer.checkpoint_shards.items():
            layer.method.load(layer, param_name, shard, torch.tensor([rows, layer.checkpoint_in_features]))
        return [f"{module_name}.{param_name}#{shard}" for shard in layer.checkpoint_shards]
    if not per_tensor and shape[0] != total:
        raise ValueError(f"checkpoint tensor {name} has shape {shape}: a stacked {module_name.rpartition('.')[2]} "
                         f"needs {total} rows ({', '.join(f'{s} {r}' for s, (r, _) in layer.checkpoint_shards.items())}), "
                         "or one value for the whole tensor")
    keys, first = [], 0
    assert layer.method is not None
    for shard, (rows, _) in layer.checkpoint_shards.items():
        assert shard is not None
        view = _ShardRows(f, name, first, None if per_tensor else rows)
        try:
            tensor = _read(view, name, layer.method.checkpoint_slice(layer, param_name, shard, tuple(view.get_shape())))
            if param_name == "bias" and layer.reduce is not None and not layer.reduce.is_first:
                tensor = torch.zeros_like(tensor)
            layer.method.load(layer, param_name, shard, tensor)
        except ValueError as exc:
            raise ValueError(f"{exc} (checkpoint tensor {name}, rows of {shard})") from None
        keys.append(f"{module_name}.{param_name}#{shard}")
        first += rows
    return keys


# FP8 KV-cache scales: vLLM's and compressed-tensors' names (self_attn.k_scale), older FP8
# checkpoints' (self_attn.k_proj.k_scale), and some exporters' (self_attn.attn.k_scale).
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def _load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    path, _, which = name.rpartition(".")
    parts = path.split(".")
    if parts[-1] in ("k_proj", "v_proj", "attn"):
        parts = parts[:-1]
    try:
        attn = model.get_submodule(".".join(parts) + ".attn")
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r}: no attention layer at {'.'.join(parts)}") from None
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a KV-cache scale must be one value (per tensor), got shape {tuple(tensor.shape)}")
    attn.set_checkpoint_kv_scale(which, float(tensor.float().reshape(()).item()))
