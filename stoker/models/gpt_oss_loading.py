"""gpt-oss's expert tensors -> a FusedMoE's shards `(expert, "w1" | "w3" | "w2")`.

Its checkpoints hold each layer's experts stacked, gate and up interleaved (gate at the even
positions, up at the odd ones):

    float (transformers 5)                       MXFP4 (the Hub's, quant_method mxfp4)
    {moe}.gate_up_proj       (E, H, 2I)          {moe}.gate_up_proj_blocks (E, 2I, H / 32, 16) uint8
    {moe}.gate_up_proj_bias  (E, 2I)             {moe}.gate_up_proj_scales (E, 2I, H / 32) uint8
    {moe}.down_proj          (E, I, H)           {moe}.down_proj_blocks    (E, H, I / 32, 16)
    {moe}.down_proj_bias     (E, H)              {moe}.down_proj_scales    (E, H, I / 32)

(the biases are float in both). Each expert's gate and up are de-interleaved here, so the
layer holds [gate; up] like every family's, and the float weights are transposed to the
(out, in) rows the methods take (the MXFP4 blocks are stored (out, in) already). Each piece
goes through the layer's method as parameter "weight" / "bias" / "blocks" / "scales"; the
method says which it takes and refuses the rest by name. Under expert parallelism only this
rank's run of experts is read (`get_slice`); under tensor parallelism the method cuts its I
(`MoEMethod.checkpoint_slice`).
"""

from __future__ import annotations

from typing import Any

import torch

from stoker.layers.moe import FusedMoE
from stoker.models.moe_loading import key

#: checkpoint leaf -> the shards it holds (for the ignore-list check and the missing-weights message)
EXPERT_PARAMS = {"gate_up_proj": "w1", "down_proj": "w2"}

# checkpoint suffix -> (projection, method parameter)
_TENSORS = {
    "gate_up_proj": ("gate_up", "weight"), "gate_up_proj_bias": ("gate_up", "bias"),
    "gate_up_proj_blocks": ("gate_up", "blocks"), "gate_up_proj_scales": ("gate_up", "scales"),
    "down_proj": ("down", "weight"), "down_proj_bias": ("down", "bias"),
    "down_proj_blocks": ("down", "blocks"), "down_proj_scales": ("down", "scales"),
}  # fmt: skip


def _pieces(which: str, param: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert's checkpoint tensor -> its shards, in the methods' (out, in) orientation."""
    if which == "down":
        return {"w2": t.t() if param == "weight" else t}  # float (I, H) -> (H, I); blocks already (H, ...)
    if param == "weight":  # (H, 2I) columns interleaved -> (I, H) each
        return {"w1": t[:, 0::2].t(), "w3": t[:, 1::2].t()}
    return {"w1": t[0::2], "w3": t[1::2]}  # bias (2I,), blocks (2I, G, 16), scales (2I, G): rows interleaved


def load_expert_tensor(moes: dict[str, FusedMoE], expert_params: dict[str, str], name: str, f: Any) -> list[str] | None:
    """Load checkpoint tensor `name` from safetensors handle `f` if it is a gpt-oss expert tensor;
    returns the keys it filled (models/moe_loading.key), None if it is none."""
    head, _, last = name.rpartition(".")
    if head not in moes or last not in _TENSORS:
        return None
    layer = moes[head]
    assert layer.method is not None
    which, param = _TENSORS[last]
    shape = tuple(f.get_slice(name).get_shape())
    if not shape or shape[0] != layer.global_num_experts:
        raise ValueError(f"checkpoint tensor {name}: expected ({layer.global_num_experts}, ...) stacked experts, got {shape}")
    held = layer.expert_split
    tensor: torch.Tensor = f.get_tensor(name) if held.is_whole else f.get_slice(name)[held.start:held.stop]
    filled = []
    try:
        for e in range(held.start, held.stop):
            for shard, whole in _pieces(which, param, tensor[e - held.start]).items():
                part = layer.method.checkpoint_slice(layer, shard, param, tuple(whole.shape))
                layer.method.load(layer, held.local(e), shard, (whole if part is None else whole[part]).contiguous(), param)
                filled.append(key(head, e, shard, param))
    except ValueError as exc:
        raise ValueError(f"{exc} (checkpoint tensor {name})") from None
    return filled


def checkpoint_name(module_key: str, expert_params: dict[str, str]) -> str:
    """An expected key (`{moe}#{e}.{shard}[.{param}]`) -> the stacked checkpoint tensor that holds it."""
    module_name, _, rest = module_key.partition("#")
    _, _, rest = rest.partition(".")
    shard, _, param = rest.partition(".")
    leaf = "down_proj" if shard == "w2" else "gate_up_proj"
    return f"{module_name}.{leaf}" + ("" if param in ("", "weight") else f"_{param}")
