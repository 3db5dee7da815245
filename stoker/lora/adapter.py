"""A PEFT LoRA adapter from its folder (`adapter_config.json` + `adapter_model.safetensors`),
checked against the served model and held in host memory until a slot needs it.

Each target projection p of layer i gets W x + scaling * B (A x), A: (r, in), B: (out, r),
scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), as PEFT computes it. An adapter on
a stacked projection (Phi-3's qkv_proj, gate_up_proj) is read as one per part (FUSED_TARGETS). What this
server cannot apply (DoRA, trained biases, modules_to_save, per-module rank or alpha patterns,
targets outside the attention and MLP projections, fan_in_fan_out weights, and on
Mixture-of-Experts models the experts, shared experts and routers: `target_parameters` or
their module names) is refused with a message that names the field or module, never loaded and
half-applied.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The projections an adapter may target, as PEFT names them in Llama/Qwen checkpoints.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections a checkpoint stores stacked (Phi-3): an adapter on one has a single A and a stacked
# B, rows in this order; B (q + 2 kv, r) x A (r, in) is [B_q A; B_k A; B_v A], so it is read as one
# adapter per part, A shared, and served by the same slots.
FUSED_TARGETS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                             "gate_up_proj": ("gate_proj", "up_proj")}
_ACCEPTED = (*TARGETS, *FUSED_TARGETS)
_WEIGHT = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# A Mixture-of-Experts module an adapter may name (PEFT's keys): an expert (experts.{e}.gate_proj,
# Mixtral's block_sparse_moe.experts.{e}.w1), the shared expert, or a router (mlp.gate, shared_expert_gate).
_MOE_MODULE = re.compile(r"(?:.*\.)?(layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:experts\b[\w.]*|shared_expert\b[\w.]*|gate))"
                         r"\.lora_[AB](?:\.default)?\.weight$")
_MOE_REFUSAL = ("LoRA on Mixture-of-Experts experts, shared experts and routers is not supported (served: the attention "
                "projections, and the MLP projections of dense layers); the adapter is refused rather than half-applied")


class LoRAError(ValueError):
    """An adapter that cannot be served as asked; the message says what to change."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    base_model: str | None
    # (layer index, projection name) -> (A (r, in), B (out, r)), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=dict)

    @property
    def targets(self) -> set[str]:
        return {module for _, module in self.weights}

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _refuse_unsupported(cfg: dict[str, Any], where: str) -> None:
    checks = (
        ("peft_type", cfg.get("peft_type", "LORA") != "LORA", "only LoRA adapters are served"),
        ("use_dora", bool(cfg.get("use_dora")), "DoRA adapters are not supported"),
        ("bias", cfg.get("bias", "none") != "none", "adapters that train biases are not supported (bias must be 'none')"),
        ("modules_to_save", bool(cfg.get("modules_to_save")), "modules_to_save (fully trained modules) is not supported"),
        ("rank_pattern", bool(cfg.get("rank_pattern")), "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", bool(cfg.get("alpha_pattern")), "per-module alphas (alpha_pattern) are not supported"),
        ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out weights (Conv1D models) are not supported"),
        ("layers_to_transform", cfg.get("layers_to_transform") not in (None, []),
         "layers_to_transform is not supported (the weights file says which layers it holds)"),
    )
    for name, bad, why in checks:
        if bad:
            raise LoRAError(f"{where}: {name}: {why}")


def load_adapter(name: str, path: str | Path, hf_config: dict[str, Any], max_rank: int,
                 served_model: str | None = None) -> LoRAAdapter:
    """Read and check one adapter folder; LoRAError naming what is wrong."""
    from safetensors.torch import load_file

    folder = Path(path)
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoRAError(f"{folder}: no adapter_config.json (a PEFT LoRA adapter folder holds adapter_config.json and "
                        "adapter_model.safetensors)")
    cfg = json.loads(cfg_path.read_text())
    where = f"adapter {name!r} ({folder})"
    if cfg.get("target_parameters"):
        # PEFT's LoRA on bare parameters: how it adapts transformers 5's fused experts
        # (mlp.experts.gate_up_proj / down_proj) when an adapter targets an MoE model's MLP;
        # first, as the rank_pattern PEFT writes with it is a symptom of this
        raise LoRAError(f"{where}: target_parameters {sorted(cfg['target_parameters'])} (mlp.experts): {_MOE_REFUSAL}")
    _refuse_unsupported(cfg, where)
    rank = int(cfg.get("r", 0))
    if rank < 1:
        raise LoRAError(f"{where}: r must be >= 1, got {cfg.get('r')!r}")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}; raise --max-lora-rank")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [t for t in _ACCEPTED if re.fullmatch(targets, t) or re.search(targets + "$", t)]
    unknown = sorted(set(targets) - set(_ACCEPTED))
    if unknown:
        raise LoRAError(f"{where}: target_modules {unknown} are not supported (only {', '.join(_ACCEPTED)})")
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise LoRAError(f"{where}: no adapter_model.safetensors (.bin adapters are not read: save with safetensors)")
    tensors = load_file(str(weights_path))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        moe = _MOE_MODULE.match(key)
        if moe is not None:
            raise LoRAError(f"{where}: weight {key!r} targets the Mixture-of-Experts module {moe.group(1)!r}: {_MOE_REFUSAL}")
        m = _WEIGHT.match(key)
        if m is None:
            raise LoRAError(f"{where}: weight {key!r} is not a LoRA A/B matrix of an attention or MLP projection")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in _ACCEPTED:
            raise LoRAError(f"{where}: weight {key!r} targets {module!r}; only {', '.join(_ACCEPTED)} are supported")
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    base = cfg.get("base_model_name_or_path")
    if served_model and base and Path(str(base)).name != Path(served_model).name and str(base) != served_model:
        logger.warning("%s was trained on %r; serving it on %r (the shapes are checked, not the weights)", where, base,
                       served_model)
    adapter = LoRAAdapter(name, str(folder), rank, scaling, base)
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        want_in, want_out = _shape(hf_config, module)
        if layer >= hf_config["num_hidden_layers"] or a.shape != (rank, want_in) or b.shape != (want_out, rank):
            raise LoRAError(f"{where}: layer {layer} {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; this model "
                            f"needs A ({rank}, {want_in}) and B ({want_out}, {rank}) in layers < "
                            f"{hf_config['num_hidden_layers']}: the adapter was trained for another model")
        parts = FUSED_TARGETS.get(module, (module,))
        sizes = [_shape(hf_config, part)[1] for part in parts]
        for part, b_part in zip(parts, b.split(sizes)):
            if (layer, part) in adapter.weights or (part != module and (layer, part) in pairs):
                raise LoRAError(f"{where}: layer {layer} has weights for both {module} and {part}")
            adapter.weights[(layer, part)] = (a.contiguous(), b_part.contiguous())
    if not adapter.weights:
        raise LoRAError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return adapter


def check_served(adapter: LoRAAdapter, targets: frozenset[tuple[int, str]], moe_layers: frozenset[int]) -> None:
    """Refuse, naming the module, an adapter with weights for a projection the model holds no
    LoRA slot for (on a Mixture-of-Experts model: a sparse layer's MLP, whose experts FusedMoE
    runs), rather than load the rest and drop those silently. `targets`: the (layer, projection)
    pairs with slots; `moe_layers`: the layers whose MLP is a Mixture-of-Experts block."""
    for layer, module in sorted(adapter.weights):
        if (layer, module) in targets:
            continue
        where = f"adapter {adapter.name!r} ({adapter.path})"
        if layer in moe_layers:
            raise LoRAError(f"{where}: layer {layer} {module} (model.layers.{layer}.mlp.{module}): layer {layer}'s MLP is "
                            f"a Mixture-of-Experts block; {_MOE_REFUSAL}")
        raise LoRAError(f"{where}: layer {layer} {module}: this model has no LoRA slot for it")


def _shape(cfg: dict[str, Any], module: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection in the checkpoint."""
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    inter = cfg["intermediate_size"]
    if module in FUSED_TARGETS:
        return hidden, sum(_shape(cfg, part)[1] for part in FUSED_TARGETS[module])
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }[module]
