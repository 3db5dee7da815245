"""Write a GGUF file from a tiny HF checkpoint, as llama.cpp's convert_hf_to_gguf.py lays one
out (metadata keys, tensor names, q/k rows permuted for llama), with each tensor in the type
the test asks for; and the HF checkpoint of the weights the file stands for (dequantized), the
reference transformers runs.

Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1 blocks come from `gguf.quants.quantize`; the gguf package
cannot quantize K-quants, so Q6_K, Q5_K and Q4_K blocks are written here (`quantize_q6_k`,
`quantize_k_affine`, the layouts of ggml's block_q6_K, block_q5_K and block_q4_K, checked
against `gguf.quants.dequantize` by the tests). A MoE checkpoint's per-expert tensors are
stacked into one (E, N, K) tensor per layer and projection (blk.N.ffn_gate_exps, ...), each
expert's rows encoded on their own, as the converter stacks them and llama-quantize encodes
them row by row. `llama_cpp_types` gives the type of each
tensor as llama.cpp's llama-quantize assigns them in its Q4_K_M, Q4_K_S and Q5_K_M files, MoE
experts included.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from stoker.models.gguf_names import permute_rows

# HF module suffix -> llama.cpp name inside blk.N
_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# A MoE checkpoint's per-expert tensors: model.layers.N.{mlp|block_sparse_moe}.experts.E.LEAF.weight
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    module, _, leaf = hf.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{leaf}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    assert m, hf
    return f"blk.{m.group(1)}.{_BLOCK[m.group(2)]}.{leaf}"


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """(N, K) float32, K a multiple of 256 -> (N, K / 256 * 210) uint8 Q6_K blocks: per 16
    values a scale s = max|w| / 31, per 256 d = max|s| / 127 (fp16) and sc = round(s / d)."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    s = np.abs(x).max(axis=-1) / 31.0  # (n, nb, 16)
    d = (np.abs(s).max(axis=-1) / 127.0).astype(np.float16)  # (n, nb)
    df = d.astype(np.float32)
    sc = np.where(df[..., None] > 0, np.round(s / np.where(df[..., None] > 0, df[..., None], 1)), 0).clip(-128, 127)
    step = df[..., None] * sc
    q = np.where(step[..., None] > 0, np.round(x / np.where(step[..., None] > 0, step[..., None], 1)), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # halves of 128, 4 runs of 32
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate([lo[:, :, :, 0] | (lo[:, :, :, 2] << 4), lo[:, :, :, 1] | (lo[:, :, :, 3] << 4)], axis=-1)  # (n, nb, 2, 64)
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)  # (n, nb, 2, 32)
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.astype(np.int8).view(np.uint8),
                             d.reshape(n, -1, 1).view(np.uint8)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def quantize_k_affine(w: np.ndarray, bits: int = 4) -> np.ndarray:
    """(N, K) float32, K a multiple of 256 -> Q4_K (bits 4: K / 256 * 144 bytes a row) or Q5_K
    (bits 5: 176) blocks: per 32 values a step s = (max - min') / (2^bits - 1) and a minimum
    m' = -min(min, 0), per 256 fp16 d = max s / 63 and dmin = max m' / 63, 6-bit sc = round(s / d),
    m = round(m' / dmin), q = round((w + dmin m) / (d sc)) in [0, 2^bits - 1] (ggml's
    block_q4_K / block_q5_K layouts: Q5_K's fifth bits in 32 bytes qh, bit i for sub-block i)."""
    n, k = w.shape
    top = (1 << bits) - 1
    x = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    mn = -np.minimum(x.min(axis=-1), 0)  # (n, nb, 8) >= 0
    s = (x.max(axis=-1) + mn) / top
    d, dmin = (s.max(axis=-1) / 63.0).astype(np.float16), (mn.max(axis=-1) / 63.0).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.where(df > 0, np.round(s / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmf > 0, np.round(mn / np.where(dmf > 0, dmf, 1)), 0).clip(0, 63).astype(np.uint8)
    step, low = (df * sc)[..., None], (dmf * m)[..., None]
    q = np.where(step > 0, np.round((x + low) / np.where(step > 0, step, 1)), 0).clip(0, top).astype(np.uint8)
    # scales: bytes 0-3 sc[0:4] | top bits of sc[4:8]; 4-7 m[0:4] | top bits of m[4:8]; 8-11 low nibbles
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)
    lo = q & 0x0F
    qs = (lo[:, :, 0::2] | (lo[:, :, 1::2] << 4)).reshape(n, k // 256, 128)  # sub-block 2i low nibbles, 2i + 1 high
    parts = [d.reshape(n, -1, 1).view(np.uint8), dmin.reshape(n, -1, 1).view(np.uint8), packed]
    if bits == 5:
        hi = (q >> 4).astype(np.uint8)  # (n, nb, 8, 32)
        parts.append(np.bitwise_or.reduce(hi << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1), axis=2))
    blocks = np.concatenate([*parts, qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    return quantize_k_affine(w, 4)


def llama_cpp_types(ftype: str, num_layers: int, tied: bool = False, num_experts: int = 0) -> dict[str, str]:
    """The GGUF type of each HF tensor (regexes for write_gguf) as llama.cpp's llama-quantize
    picks them (llama_tensor_get_type in src/llama-quant.cpp) for a Llama / Qwen model whose
    rows are whole 256-value super-blocks: Q4_K_M and Q5_K_M give attn_v and ffn_down of the
    "more bits" layers (the first and last eighth, and every third between) Q6_K; Q4_K_S gives
    attn_v of the first four layers and ffn_down of the first eighth Q5_K; the output (or,
    tied, token_embd) is Q6_K; token_embd otherwise the base type. A MoE model's stacked
    experts (Qwen3-MoE, Mixtral: one ffn_down_exps per layer, llama-quantize reading the layer
    from its name) follow the same rules, ffn_down_exps as ffn_down and gate/up in the base
    type; with `num_experts` 8 (Mixtral) attn_v and attn_k are Q8_0. Qwen2-MoE's shared expert
    (a second ffn_down per layer, which shifts llama-quantize's count) is not modelled."""
    base = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K"}[ftype]

    def more_bits(i: int) -> bool:
        return i < num_layers // 8 or i >= 7 * num_layers // 8 or (i - num_layers // 8) % 3 == 2

    types: dict[str, str] = {}
    for i in range(num_layers):
        if ftype == "Q4_K_S":
            v, down = ("Q5_K" if i < 4 else base), ("Q5_K" if i < num_layers // 8 else base)
        else:
            v = down = "Q6_K" if more_bits(i) else base
        if num_experts == 8:  # llama-quantize: "for the 8-expert model, bumping this to Q8_0"
            v = "Q8_0"
            types[rf"layers\.{i}\.self_attn\.k_proj\.weight"] = "Q8_0"
        types[rf"layers\.{i}\.self_attn\.v_proj\.weight"] = v
        types[rf"layers\.{i}\.(mlp|block_sparse_moe)\.(experts\.\d+\.(down_proj|w2)|down_proj)\.weight"] = down
    types[r"lm_head"] = "Q6_K"
    types[r"embed_tokens"] = "Q6_K" if tied else base
    types[r"proj\.weight|experts\.\d+\.w[13]\.weight"] = base
    return types


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """A float (N, K) tensor in GGUF type `kind`: its data as the writer takes it."""
    import gguf

    if kind == "F32":
        return w.astype(np.float32)
    if kind == "F16":
        return w.astype(np.float16)
    if kind == "Q6_K":
        return quantize_q6_k(w)
    if kind in ("Q4_K", "Q5_K"):
        return quantize_k_affine(w, 4 if kind == "Q4_K" else 5)
    if kind in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"):  # zero blocks: only refusals are tested with them
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        return np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])


def write_gguf(src: Path, dst: Path, types: dict[str, str], arch: str, dequantized_dst: Path | None = None,
               with_tokenizer: bool = True, chat_template: str | None = None) -> Path:
    """The GGUF file of HF checkpoint `src` at `dst`. `types`: regex over HF tensor names ->
    GGUF type (first match; 1-D tensors are F32 unless named). llama: q/k rows permuted as
    convert_hf_to_gguf.py does. `dequantized_dst`: the HF checkpoint of what the file holds."""
    import gguf
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    tensors = {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(dst), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if with_tokenizer:
        tok = json.loads((src / "tokenizer.json").read_text())
        vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        added = {a["id"] for a in tok["added_tokens"]}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([t for t, _ in vocab])
        writer.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for _, i in vocab])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
        writer.add_bos_token_id(cfg["bos_token_id"])
        writer.add_eos_token_id(cfg["eos_token_id"])
        if chat_template:
            writer.add_chat_template(chat_template)
    dequantized: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}  # (layer, leaf) -> expert -> encoded rows
    for name, t in tensors.items():
        kind = next((k for pat, k in types.items() if re.search(pat, name)), "F32" if t.dim() == 1 else "F32")
        if (m := _EXPERT.fullmatch(name)) is not None:
            data = encode(t.numpy(), kind)
            if dequantized_dst is not None:
                deq = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(t.shape)
                dequantized[name] = torch.from_numpy(deq.copy())
            stack = experts.setdefault((int(m.group(1)), m.group(3)), {})
            stack[int(m.group(2))] = data
            if len(stack) == num_experts:  # all of this layer's experts: one (E, N, bytes) tensor
                writer.add_tensor(f"blk.{m.group(1)}.{_EXPERT_GGUF[m.group(3)]}.weight",
                                  np.ascontiguousarray(np.stack([stack[e] for e in range(num_experts)])),
                                  raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        w = t.numpy()
        data = encode(w, kind) if t.dim() == 2 else w.astype(np.float32 if kind == "F32" else np.float16)
        if dequantized_dst is not None:
            deq = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(w.shape)
            dequantized[name] = torch.from_numpy(deq.copy())
        if arch == "llama" and re.search(r"self_attn\.(q|k)_proj\.", name):  # as convert_hf_to_gguf.py
            n = heads if ".q_proj." in name else kv_heads
            data = permute_rows(torch.from_numpy(np.ascontiguousarray(data)), n).numpy()
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(data), raw_dtype=gguf.GGMLQuantizationType[kind])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":  # as LlamaModel.generate_extra_tensors
        base = float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0))
        writer.add_tensor("rope_freqs.weight", _llama3_factors(base, head_dim, rope, cfg).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if dequantized_dst is not None:
        shutil.copytree(src, dequantized_dst, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in dequantized.items()}, str(dequantized_dst / "model.safetensors"),
                  metadata={"format": "pt"})
    return dst


def _llama3_factors(base: float, head_dim: int, rope: dict, cfg: dict) -> torch.Tensor:
    """The converter's rope_freqs, in its float32 arithmetic; its original length is the
    config's top-level original_max_position_embeddings, else 8192 (not rope_scaling's)."""
    import math

    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = cfg.get("original_max_position_embeddings", 8192)
    values = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            values.append(1.0)
        elif wavelen > original / low:
            values.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            values.append(float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(values, dtype=torch.float32)
