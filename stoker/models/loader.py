"""Load a Hugging Face checkpoint directory: config.json + safetensors (single or sharded).

Every tensor in the checkpoint must land in a parameter of the right shape and every
parameter must be filled; anything else is an error that names the tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from stoker.layers.rotary import rope_parameters
from stoker.models.registry import get_model_class

logger = logging.getLogger(__name__)

# Present in some checkpoints, recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist; pass a Hugging Face checkpoint folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing: a checkpoint folder needs config.json")
    cfg = json.loads(config_file.read_text())
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


def build_model(hf_config: dict[str, Any], max_position: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    model_cls = get_model_class(hf_config.get("architectures"))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(hf_config, max_position)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    tied = bool(model.config.get("tie_word_embeddings", False))
    filled: set[str] = set()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(name)
                filled.update(_load_one(model, params, packed, name, tensor))
    expected = expected_loaded_names(model)
    if tied:
        expected.discard("lm_head.weight")
        filled.add("lm_head.weight")
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))


def _load_one(model: nn.Module, params: dict[str, nn.Parameter], packed: dict[str, tuple[str, str]], name: str, tensor: torch.Tensor) -> list[str]:
    """Copy one checkpoint tensor into its parameter (or its shard of a merged one)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            merged, shard = packed[part]
            module_name = ".".join(parts[:i] + [merged])
            param_name = ".".join(parts[i + 1 :])
            module = model.get_submodule(module_name)
            module.load_shard(param_name, shard, tensor)
            return [f"{module_name}.{param_name}#{shard}"]
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
    param = params[name]
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return [name]


def expected_loaded_names(model: nn.Module) -> set[str]:
    """Every parameter name, with merged parameters split into `name#shard` entries."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        shards = getattr(module, "shard_offsets", None)
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if shards:
                names.update(f"{full}#{shard}" for shard in shards)
            else:
                names.add(full)
    return names
