"""Build a pooling model and fill it from the folder's safetensors, as models/loader.py does.

Each model says how checkpoint names map to its own (`checkpoint_name`: prefixes dropped,
unused tensors skipped); tensors then go through the same `_load_one` as the generative
models (projections through their weight method, shard by shard), every expected tensor
must arrive, and each method re-lays its weights for its backend at the end.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from stoker.layers.linear import Linear
from stoker.models.loader import _load_one, build_with_methods, safetensors_files
from stoker.pooling.bert import BertPoolingModel
from stoker.pooling.config import PoolingConfig
from stoker.pooling.decoder import DecoderEmbeddingModel

logger = logging.getLogger(__name__)


class _Renamed:
    """A safetensors file seen under the model's names (what `_load_one` reads through)."""

    def __init__(self, f: Any, checkpoint_names: dict[str, str]) -> None:
        self.f, self.names = f, checkpoint_names

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(self.names[name])

    def get_slice(self, name: str) -> Any:
        return self.f.get_slice(self.names[name])


def build_pooling_model(config: PoolingConfig, hf_config: dict[str, Any], dtype: torch.dtype,
                        device: torch.device) -> nn.Module:
    """The model with every projection's weight method chosen and parameters uninitialised."""

    def make() -> nn.Module:
        if config.is_encoder:
            return BertPoolingModel(hf_config, is_classifier=config.kind == "classify")
        return DecoderEmbeddingModel(hf_config, config.family, config.max_model_len)

    return build_with_methods(make, dtype, device, what="pooling model projections")


def load_pooling_weights(model: nn.Module, model_dir: str | Path) -> None:
    params = dict(model.named_parameters())
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    filled: set[str] = set()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = {}
            for ckpt_name in f.keys():
                own = model.checkpoint_name(ckpt_name)
                if own is not None:
                    names[own] = ckpt_name
            view = _Renamed(f, names)
            for own in names:
                filled.add(_load_one(params, linears, {}, packed, own, view))
    expected = {n for n in params if not any(n.startswith(prefix + ".") for prefix in linears)}
    for module_name, layer in linears.items():
        assert layer.method is not None
        wanted = layer.method.checkpoint_params(layer) + (("bias",) if layer.has_bias else ())
        for shard in list(layer.shard_offsets) or [None]:
            expected.update(f"{module_name}.{p}#{shard}" for p in wanted)
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
    for layer in linears.values():
        assert layer.method is not None
        layer.method.process_after_loading(layer)


def load_pooling_model(model_dir: str | Path, config: PoolingConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    model = build_pooling_model(config, hf_config, dtype, device)
    load_pooling_weights(model, model_dir)
    return model
