"""GGUF tensor names -> Hugging Face names, and llama.cpp's Q/K row order undone.

llama.cpp's names (gguf-py's tensor_mapping, as convert_hf_to_gguf.py writes them) for the
decoder families Stoker reads from GGUF: llama (Llama, Mistral; Mixtral, whose sparse block is
`block_sparse_moe`), qwen2, qwen3, qwen2moe and qwen3moe (their sparse block is `mlp`).

A MoE layer's experts are one 3-D tensor per projection in a GGUF file (`blk.N.ffn_gate_exps`:
(E, I, H) in torch order, the converter's stack of the per-expert tensors); `expert_names`
gives the per-expert HF names it stands for, in expert order.
"""

from __future__ import annotations

import re

import torch

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # qwen2moe's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The sparse block's router and its experts' leaf names, per GGUF architecture
ROUTER = "ffn_gate_inp"
_MOE_BLOCK = {"llama": "block_sparse_moe"}  # others: "mlp"
_EXPERT_LEAVES = {
    "llama": {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"},
    "qwen": {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
}
# Not weights: Llama 3's rope scaling as per-dimension frequency factors (models/gguf_rope.py)
ROPE_FREQS = "rope_freqs.weight"
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"([a-z_]+)\.(weight|bias)")


def hf_name(name: str, arch: str = "llama") -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; a name with no
    counterpart is refused (the loader would otherwise drop a tensor the file says it needs).
    Expert tensors have many (`expert_names`)."""
    m = _BLOCK_NAME.fullmatch(name)
    if m and m.group(2) == ROUTER:
        return f"model.layers.{m.group(1)}.{_MOE_BLOCK.get(arch, 'mlp')}.gate.{m.group(3)}"
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_NAME.fullmatch(name)
    if m and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in Stoker's llama / qwen2 / qwen3 / qwen2moe / "
                     "qwen3moe models")


def is_experts(name: str) -> bool:
    """Whether `name` is a MoE layer's stacked experts (blk.N.ffn_{gate,up,down}_exps.weight)."""
    m = _BLOCK_NAME.fullmatch(name)
    return bool(m and m.group(2) in _EXPERT_LEAVES["qwen"] and m.group(3) == "weight")


def expert_names(name: str, arch: str, num_experts: int) -> list[str]:
    """blk.3.ffn_gate_exps.weight -> [model.layers.3.mlp.experts.{e}.gate_proj.weight for each
    expert e] (Mixtral: block_sparse_moe.experts.{e}.w1): the checkpoint names of its slices."""
    m = _BLOCK_NAME.fullmatch(name)
    if not is_experts(name) or m is None:
        raise ValueError(f"GGUF tensor {name!r} is not a MoE layer's experts")
    leaf = _EXPERT_LEAVES["llama" if arch == "llama" else "qwen"][m.group(2)]
    block = f"model.layers.{m.group(1)}.{_MOE_BLOCK.get(arch, 'mlp')}.experts"
    return [f"{block}.{e}.{leaf}.weight" for e in range(num_experts)]


def permuted_heads(name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads llama.cpp's converter permuted this tensor's rows over (q: num_heads, k:
    num_kv_heads), or None for a tensor it left alone. Only llama-architecture files are
    permuted (qwen2/qwen3 use NeoX-style rotary, the HF order)."""
    m = _BLOCK_NAME.fullmatch(name)
    if m and m.group(2) == "attn_q":
        return num_heads
    if m and m.group(2) == "attn_k":
        return num_kv_heads
    return None


def permute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What convert_hf_to_gguf.py's LlamaModel.permute does to q_proj / k_proj (weights,
    biases, or any per-row tensor such as quantized rows' scales): within each head of
    head_dim rows, HF's rotate-half order [first halves; second halves] becomes llama.cpp's
    interleaved pairs: new row 2 j + p = old row p * head_dim / 2 + j. (rows, ...) -> same."""
    n = rows.shape[0]
    return rows.reshape(num_heads, 2, n // num_heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `permute_rows`: a GGUF file's q / k rows back in HF's order."""
    n = rows.shape[0]
    if n % (2 * num_heads):
        raise ValueError(f"{n} rows do not split into {num_heads} heads of an even head_dim")
    return rows.reshape(num_heads, n // num_heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
