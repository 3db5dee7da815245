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

Under expert parallelism a rank reads only the experts it holds (`FusedMoE.expert_split`):
another rank's expert tensor is recognised and skipped unread, and the stacked layout is read
through `get_slice` for this rank's run of experts only. Keys name experts by their global
index (the checkpoint's); the method sees the local index (its row in the stacked weights).
"""

from __future__ import annotations

from typing import Any

import torch

from stoker.layers.moe import EXPERT_SHARDS, FusedMoE

QWEN_EXPERT_PARAMS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expected_keys(module_name: str, layer: FusedMoE) -> set[str]:
    """The keys `load_expert_tensor` returns once every expert this rank holds brought its tensors
    (the weights, and a quantized method's scales: `MoEMethod.checkpoint_params`)."""
    assert layer.method is not None
    held, params = layer.expert_split, layer.method.checkpoint_params() + (("bias",) if layer.has_bias else ())
    return {key(module_name, e, s, p) for e in range(held.start, held.stop) for s in EXPERT_SHARDS for p in params}


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
        return _load_stacked(moes[head], head, last, f, name)
    # {moe}.{e}.{leaf}.{param}: the weight, or a quantized checkpoint's scale / packed weight /
    # shape / zero point; the method says which it takes, and refuses the rest by name.
    rest, _, leaf = head.rpartition(".")
    module_name, _, expert = rest.rpartition(".")
    if module_name not in moes or not expert.isdigit() or leaf not in expert_params:
        return None
    layer, shard = moes[module_name], expert_params[leaf]
    assert layer.method is not None
    if int(expert) >= layer.global_num_experts:
        raise ValueError(f"checkpoint tensor {name}: expert {expert} does not exist (the config has "
                         f"{layer.global_num_experts} experts)")
    if not layer.expert_split.holds(int(expert)):
        return []  # another rank's expert (expert parallelism): not read here
    try:
        part = layer.method.checkpoint_slice(layer, shard, last, tuple(f.get_slice(name).get_shape()))
        tensor = f.get_tensor(name) if part is None else f.get_slice(name)[part]
        layer.method.load(layer, layer.expert_split.local(int(expert)), shard, tensor, last)
    except ValueError as exc:
        raise ValueError(f"{exc} (checkpoint tensor {name})") from None
    return [key(module_name, int(expert), shard, last)]


def _load_stacked(layer: FusedMoE, module_name: str, which: str, f: Any, name: str) -> list[str]:
    """transformers 5's in-memory layout: every expert in one tensor; split it per expert
    (reading only this rank's experts under expert parallelism)."""
    assert layer.method is not None
    shape = tuple(f.get_slice(name).get_shape())
    if len(shape) != 3 or shape[0] != layer.global_num_experts:
        raise ValueError(f"{module_name}.{which}: expected ({layer.global_num_experts}, ...) stacked experts, "
                         f"got {shape}")
    held = layer.expert_split
    tensor: torch.Tensor = f.get_tensor(name) if held.is_whole else f.get_slice(name)[held.start:held.stop]
    i = layer.checkpoint_intermediate_size
    pieces = {"w1": lambda t: t[:i], "w3": lambda t: t[i:]} if which == "gate_up_proj" else {"w2": lambda t: t}
    filled = []
    for e in range(held.start, held.stop):
        for shard, cut in pieces.items():
            whole = cut(tensor[e - held.start])
            part = layer.checkpoint_slice(shard, tuple(whole.shape))
            layer.method.load(layer, held.local(e), shard, whole if part is None else whole[part])
            filled.append(key(module_name, e, shard))
    return filled
