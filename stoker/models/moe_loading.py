"""Checkpoint names of Mixture-of-Experts weights -> a FusedMoE's stacked parameters.

Public checkpoints (and what transformers 5 writes with save_pretrained) keep one tensor per
expert and projection:

    {moe}.{e}.gate_proj.weight / up_proj / down_proj      Qwen2-MoE, Qwen3-MoE, OLMoE
    {moe}.{e}.w1.weight / w3 / w2                         Mixtral

where {moe} is the FusedMoE's module name (model.layers.3.mlp.experts). A model says which
leaf is which shard in `expert_params` ({"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}).
transformers 5 holds the experts stacked in memory (`{moe}.gate_up_proj` (E, 2I, H),
`{moe}.down_proj` (E, H, I)); a checkpoint saved in that layout loads too.
Each tensor goes through the layer's method as shard `(expert, "w1" | "w2" | "w3")`.
"""

from __future__ import annotations

from typing import Any

import torch

from stoker.layers.moe import EXPERT_SHARDS, FusedMoE

QWEN_EXPERT_PARAMS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expected_keys(module_name: str, layer: FusedMoE) -> set[str]:
    """The keys `load_expert_tensor` returns once every expert's tensors came (the weights, and
    a quantized method's scales: `MoEMethod.checkpoint_params`)."""
    assert layer.method is not None
    params = layer.method.checkpoint_params()
    return {key(module_name, e, s, p) for e in range(layer.num_experts) for s in EXPERT_SHARDS for p in params}


def key(module_name: str, expert: int, shard: str, param: str = "weight") -> str:
    return f"{module_name}#{expert}.{shard}" + ("" if param == "weight" else f".{param}")


def checkpoint_name(module_key: str, expert_params: dict[str, str]) -> str:
    """An expected key -> the per-expert checkpoint name (for the missing-weights message)."""
    module_name, _, rest = module_key.partition("#")
    expert, _, rest = rest.partition(".")
    shard, _, param = rest.partition(".")
    leaf = next((n for n, s in expert_params.items() if s == shard), shard)
    return f"{module_name}.{expert}.{leaf}.{param or 'weight'}"


def load_expert_tensor(
    moes: dict[str, FusedMoE], expert_params: dict[str, str], name: str, f: Any
) -> list[str] | None:
    """Load checkpoint tensor `name` from safetensors handle `f` if it is an expert weight;
    returns the keys it filled, None if it is no expert weight."""
    head, _, last = name.rpartition(".")
    if head in moes and last in ("gate_up_proj", "down_proj"):
        return _load_stacked(moes[head], head, last, f.get_tensor(name))
    # {moe}.{e}.{leaf}.{param}: the weight, or a quantized checkpoint's scale / packed weight /
    # shape / zero point; the method says which it takes, and refuses the rest by name.
    rest, _, leaf = head.rpartition(".")
    module_name, _, expert = rest.rpartition(".")
    if module_name not in moes or not expert.isdigit() or leaf not in expert_params:
        return None
    layer, shard = moes[module_name], expert_params[leaf]
    assert layer.method is not None
    try:
        part = layer.method.checkpoint_slice(layer, shard, last, tuple(f.get_slice(name).get_shape()))
        tensor = f.get_tensor(name) if part is None else f.get_slice(name)[part]
        layer.method.load(layer, int(expert), shard, tensor, last)
    except ValueError as exc:
        raise ValueError(f"{exc} (checkpoint tensor {name})") from None
    return [key(module_name, int(expert), shard, last)]


def _load_stacked(layer: FusedMoE, module_name: str, which: str, tensor: torch.Tensor) -> list[str]:
    """transformers 5's in-memory layout: every expert in one tensor; split it per expert."""
    assert layer.method is not None
    if tensor.dim() != 3 or tensor.shape[0] != layer.num_experts:
        raise ValueError(f"{module_name}.{which}: expected ({layer.num_experts}, ...) stacked experts, "
                         f"got {tuple(tensor.shape)}")
    i = layer.checkpoint_intermediate_size
    pieces = {"w1": lambda t: t[:i], "w3": lambda t: t[i:]} if which == "gate_up_proj" else {"w2": lambda t: t}
    filled = []
    for e in range(layer.num_experts):
        for shard, cut in pieces.items():
            whole = cut(tensor[e])
            part = layer.checkpoint_slice(shard, tuple(whole.shape))
            layer.method.load(layer, e, shard, whole if part is None else whole[part])
            filled.append(key(module_name, e, shard))
    return filled
