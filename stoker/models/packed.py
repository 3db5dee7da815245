"""How a model's merged projections map back to the checkpoint's names.

A model file stacks q/k/v and gate/up into one GEMM each and says, in `packed_modules`, which
checkpoint module each shard of a merged module was (`q_proj` -> (`qkv_proj`, "q")). The loader
names missing tensors by it, and the method chooser asks a quantization config about each shard
under the checkpoint's name. A checkpoint that stores a merged module already stacked (Phi-3's
qkv_proj and gate_up_proj) says so in `fused_checkpoint_modules`: its name is the merged one.
"""

from __future__ import annotations

from torch import nn


def checkpoint_module_name(model: nn.Module, module_name: str, shard: str | None) -> str:
    """The checkpoint's module name for a merged module's shard (model.layers.0.self_attn.qkv_proj,
    "q" -> model.layers.0.self_attn.q_proj); the name itself for an unmerged module."""
    if shard is None:
        return module_name
    parent, _, leaf = module_name.rpartition(".")
    if leaf in getattr(model, "fused_checkpoint_modules", {}):
        return module_name  # the checkpoint stacks the shards itself (Phi-3's qkv_proj, gate_up_proj)
    for ckpt, (merged, s) in getattr(model, "packed_modules", {}).items():
        if merged == leaf and s == shard:
            return f"{parent}.{ckpt}" if parent else ckpt
    return f"{module_name}#{shard}"
