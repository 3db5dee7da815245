"""Multi-head latent attention (MLA: DeepSeek-V2 / V3, Kimi-K2) over a latent paged KV cache.

Per token and layer the cache holds ONE vector of `kv_lora_rank + qk_rope_head_dim` values,
shared by every head: the compressed KV (`kv_a_proj_with_mqa`'s first `kv_lora_rank` outputs
after `kv_a_layernorm`) followed by the rotated shared rope key. The cache is
(num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim), bound by the runner as the
layer's `k_cache` (there is no V cache: the model's KVCacheSpec says `kv_tensors=1`).

`kv_b_proj` (H x (qk_nope + v), kv_lora_rank) expands a latent c to per-head keys and values:
k_nope_h = W_UK_h c, v_h = W_UV_h c. Two ways to attend, equal in exact arithmetic:
  * expanded (prefill, chunks, prefix-cache extends): gather the sequence's latents, expand
    them to per-head K/V and run causal attention with the query's offset in the context;
  * absorbed (decode): q_nope_h^T W_UK_h c = (W_UK_h^T q_nope_h)^T c, so the query is folded
    into latent space (H, kv_lora_rank), concatenated with its rope part and attended over the
    latent rows as one shared "head" of width kv_lora_rank + rope; the (H, kv_lora_rank)
    result is mapped to values by W_UV after the softmax. A decode step reads the latent once
    for all heads, never the expanded K/V.
The expanded path is torch code looping over sequences on the host; the absorbed decode runs one
paged kernel for all of a step's decodes (layers/mla_kernels.decode_kernel: Triton on CUDA, C on
CPU float32, else the torch twin; each batch-invariant). Scores and softmax run in float32. The
cache may be FP8 (`--kv-cache-dtype fp8`): rows stored as e4m3 / k_scale (layers/mla_kernels.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import WHOLE, Partition
from stoker.kernels import ops
from stoker.layers.forward_context import get_forward_context
from stoker.layers.linear import Linear
from stoker.layers.mla_kernels import decode_kernel, decode_query_dtype, gather_latents, store_latents
from stoker.layers.norm import RMSNorm
from stoker.layers.rotary import RotaryEmbedding, rope_parameters


def mla_softmax_scale(cfg: dict[str, Any]) -> float:
    """1/sqrt(qk_nope + qk_rope), times DeepSeek YaRN's mscale(factor, mscale_all_dim)^2 when
    the rope is scaled (transformers' yarn_apply_mscale: the temperature both q and k would
    carry is folded into the softmax scale)."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    p = rope_parameters(cfg)
    mscale_all_dim = p.get("mscale_all_dim") or 0
    if p["rope_type"] != "default" and mscale_all_dim:
        factor = float(p["factor"])
        m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def block_fp8_of(cfg: dict[str, Any]) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight blocks ([128, 128] in DeepSeek's), None when not block-FP8."""
    qc = cfg.get("quantization_config") or {}
    block = qc.get("weight_block_size") if str(qc.get("quant_method", "")).lower() == "fp8" else None
    return (int(block[0]), int(block[1])) if block else None


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary: pairs (x0, x1), (x2, x3), ... each turned by one angle;
    the result laid out [rotated evens | rotated odds] as transformers' DeepSeek-V3 writes it
    (q and k share the layout, so their dot products are those of the paired form).
    x (T, h, R), cos/sin (T, 1, R/2) float32."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's layout (`rope_interleave` false): first half against second half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: (H * (qk_nope + v), kv_lora_rank), held as a float weight because both
    attention paths read its per-head blocks (W_UK, W_UV) directly. A block-FP8 checkpoint
    (DeepSeek's: `weight_block_size` [b0, b1], `weight_scale_inv` (ceil(N / b0), ceil(K / b1)))
    is dequantized into it once, at the first forward after loading."""

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                 block: tuple[int, int] | None = None, heads: slice | None = None) -> None:
        super().__init__()
        self.num_heads, self.qk_nope_head_dim, self.v_head_dim = num_heads, qk_nope_head_dim, v_head_dim
        # Tensor parallelism: every rank holds the whole (small) weight, and reads its heads
        self.heads = heads or slice(0, num_heads)
        rows = num_heads * (qk_nope_head_dim + v_head_dim)
        self.weight = nn.Parameter(torch.empty(rows, kv_lora_rank), requires_grad=False)
        self.block = block
        if block is not None:
            scales = (-(-rows // block[0]), -(-kv_lora_rank // block[1]))
            self.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.float32), requires_grad=False)

    @torch.no_grad()
    def _dequantize(self) -> None:
        """weight (the e4m3 values, exactly, in the model dtype) x its block's scale."""
        b0, b1 = self.block  # type: ignore[misc]
        rows, cols = self.weight.shape
        scale = self.weight_scale_inv.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
        self.weight.copy_((self.weight.float() * scale).to(self.weight.dtype))
        self.block = None

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, qk_nope, r) and W_UV (H, v, r) of this rank's heads, views of the weight."""
        if self.block is not None:
            self._dequantize()
        w = self.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)[self.heads]
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]


def mla_expanded_attention(
    q_nope: torch.Tensor,  # (n, H, nope)
    q_pe: torch.Tensor,  # (n, H, R)
    latents: torch.Tensor,  # (L, r + R): the sequence's whole context, the n queries last
    w_uk: torch.Tensor,  # (H, nope, r)
    w_uv: torch.Tensor,  # (H, v, r)
    scale: float,
) -> torch.Tensor:
    """Causal attention of the last n context tokens over all L, with the latents expanded to
    per-head keys and values -> (n, H, v) float32."""
    n, r = q_nope.shape[0], w_uk.shape[-1]
    c, k_pe = latents[:, :r].float(), latents[:, r:].float()  # (L, r), (L, R)
    k_nope = torch.einsum("lr,hdr->hld", c, w_uk.float())  # (H, L, nope)
    v = torch.einsum("lr,hdr->hld", c, w_uv.float())  # (H, L, v)
    scores = torch.einsum("nhd,hld->hnl", q_nope.float(), k_nope) + torch.einsum("nhd,ld->hnl", q_pe.float(), k_pe)
    L = latents.shape[0]
    query_pos = torch.arange(L - n, L, device=latents.device)[:, None]  # (n, 1)
    mask = torch.arange(L, device=latents.device)[None, :] > query_pos  # (n, L): the future
    probs = torch.softmax((scores * scale).masked_fill(mask, float("-inf")), dim=-1)  # (H, n, L)
    return torch.einsum("hnl,hld->nhd", probs, v)


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """One token's query in latent space: [W_UK_h^T q_nope_h | q_pe_h] -> (H, r + R) float32,
    one shared "head" of width r + R."""
    q_latent = torch.einsum("hd,hdr->hr", q_nope.float(), w_uk.float())  # (H, r)
    return torch.cat([q_latent, q_pe.float()], dim=-1)


def mla_absorbed_decode(
    q_nope: torch.Tensor,  # (H, nope): one query token
    q_pe: torch.Tensor,  # (H, R)
    latents: torch.Tensor,  # (L, r + R)
    w_uk: torch.Tensor,  # (H, nope, r)
    w_uv: torch.Tensor,  # (H, v, r)
    scale: float,
) -> torch.Tensor:
    """One token attending over its whole context in latent space -> (H, v) float32."""
    r = w_uk.shape[-1]
    q = absorb_query(q_nope, q_pe, w_uk)  # (H, r + R)
    kv = latents.float()  # (L, r + R): keys; their first r columns are also the values
    probs = torch.softmax((q @ kv.T) * scale, dim=-1)  # (H, L)
    out_latent = probs @ kv[:, :r]  # (H, r)
    return torch.einsum("hr,hdr->hd", out_latent, w_uv.float())  # W_UV after attention: (H, v)


class LatentAttention(nn.Module):
    """The paged part of MLA: stores each step's latents, attends over them (decodes absorbed,
    the rest expanded). `k_cache` (num_blocks, block_size, 1, r + R) is bound by the runner;
    `v_cache` stays empty."""

    graph_capturable = False  # loops over sequences on the host (runner: CUDA graphs off)
    # Decodes attend absorbed; False runs them expanded like a prefill (for measuring the two
    # against each other: benchmarks/mla_decode_cpu.py). Either gives the same result.
    absorbed_decode = True

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float,
                 up: LatentUpProjection) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim = num_heads, kv_lora_rank, qk_rope_head_dim
        self.num_kv_heads, self.head_dim = 1, kv_lora_rank + qk_rope_head_dim  # one latent "head" per token
        self.scale = scale
        self._up = [up]  # not a submodule: kv_b_proj is the attention's, under its checkpoint name
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # FP8 caches: the latent's dequantization scale (the checkpoint's k_scale, else 1.0; set
        # by the runner). v_scale is kept for the runner's bookkeeping: the values are the
        # latent's first kv_lora_rank columns, stored under k_scale.
        self.k_scale = self.v_scale = 1.0
        self.checkpoint_kv_scales: dict[str, float] = {}
        self.kernels: ops.Kernels = ops.TORCH  # the builder binds the device's set (models/method_chooser.py)

    def set_checkpoint_kv_scale(self, which: str, value: float) -> None:
        """Record the checkpoint's k_scale (the latent's); a v_scale is accepted and unused."""
        if which not in ("k_scale", "v_scale") or not value > 0:
            raise ValueError(f"{which} = {value}: a KV-cache scale must be k_scale or v_scale and positive")
        self.checkpoint_kv_scales[which] = value

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q_nope (T, H, nope), q_pe (T, H, R) rotated, latent (T, r) normed, k_pe (T, R) rotated
        -> (T, H, v) in q's dtype."""
        md = get_forward_context().attn_metadata
        if md is None:
            raise RuntimeError("latent attention ran in a forward without AttentionMetadata")
        cache = self.k_cache
        store_latents(torch.cat([latent, k_pe], dim=-1), cache, md.slot_mapping, self.k_scale)  # (T, r + R) rows
        w_uk, w_uv = self._up[0].per_head()
        out = torch.empty(q_nope.shape[0], self.num_heads, w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
        cu, lens = md.cu_seqlens_q, md.context_lens_list
        nd = md.num_decodes if self.absorbed_decode else 0
        if nd:  # decodes (one token each, rows 0..nd-1): absorbed, one paged call for all of them
            # per sequence, so a row's absorption does not depend on the batch
            q = torch.stack([absorb_query(q_nope[i], q_pe[i], w_uk) for i in range(nd)])  # (nd, H, r + R) float32
            q = q.to(decode_query_dtype(self.kernels.name, q_nope.dtype))
            block_tables, context_lens = md.decode_views()
            out_latent = decode_kernel(self.kernels.name)(q, cache, block_tables, context_lens, self.kv_lora_rank,
                                                          self.scale, self.k_scale)  # (nd, H, r) float32
            for i in range(nd):  # W_UV after attention: (H, r) -> (H, v)
                out[i] = torch.einsum("hr,hdr->hd", out_latent[i], w_uv.float())
        for i in range(nd, len(lens)):  # prefills, chunks, extends (and decodes when not absorbed): expanded
            start, stop = cu[i], cu[i + 1]
            if stop == start:
                continue
            latents = gather_latents(cache, md.block_tables[i], lens[i], self.k_scale)
            out[start:stop] = mla_expanded_attention(q_nope[start:stop], q_pe[start:stop], latents, w_uk, w_uv,
                                                     self.scale)
        return out


class MLAAttention(nn.Module):
    """DeepSeek-V2/V3's attention block. Checkpoint: self_attn.q_proj (q_lora_rank null) or
    self_attn.q_a_proj, q_a_layernorm, q_b_proj; self_attn.kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj; self_attn.o_proj (biases on q_a / kv_a / o with `attention_bias`).

    Tensor parallelism (`heads`: this rank's part of the heads): q_proj / q_b_proj column-parallel
    and o_proj row-parallel over the heads (one all-reduce), q_a, kv_a, their norms and the
    latent replicated (every rank caches the whole latent), kv_b_proj whole on every rank, read
    for this rank's heads."""

    def __init__(self, cfg: dict[str, Any], rotary: RotaryEmbedding, heads: Partition = WHOLE,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        hidden, bias = cfg["hidden_size"], bool(cfg.get("attention_bias", False))
        total_heads = cfg["num_attention_heads"]
        self.num_heads = heads.size(total_heads)
        self.q_lora_rank = cfg.get("q_lora_rank")
        self.kv_lora_rank = int(cfg["kv_lora_rank"])
        self.nope, self.rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        self.v_head_dim = int(cfg["v_head_dim"])
        if self.rope % 2:
            raise ValueError(f"qk_rope_head_dim {self.rope} must be even (rotary turns pairs)")
        q_rows = total_heads * (self.nope + self.rope)
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # transformers' default eps (1e-6), as the reference
            self.q_b_proj = Linear(self.q_lora_rank, q_rows, out_split=heads)
        else:
            self.q_proj = Linear(hidden, q_rows, out_split=heads)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = LatentUpProjection(self.kv_lora_rank, total_heads, self.nope, self.v_head_dim,
                                            block_fp8_of(cfg), slice(*heads.range(total_heads)))
        self.o_proj = Linear(total_heads * self.v_head_dim, hidden, bias, in_split=heads,
                             tp=tp if not heads.is_whole else None)
        self.rotary = rotary
        self.interleaved = bool(cfg.get("rope_interleave", True))
        self.attn = LatentAttention(self.num_heads, self.kv_lora_rank, self.rope, mla_softmax_scale(cfg), self.kv_b_proj)

    def _rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x (T, h, R) -> rotated at `positions` (T,)."""
        cos, sin = self.rotary.cos_sin_cache[positions].chunk(2, dim=-1)  # (T, R/2) each, float32
        rotate = rotate_pairs if self.interleaved else rotate_halves
        return rotate(x, cos[:, None], sin[:, None])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora_rank else self.q_proj(hidden)
        q_nope, q_pe = q.view(t, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # (T, r)
        q_pe = self._rotate(positions, q_pe)  # (T, H, R)
        k_pe = self._rotate(positions, k_pe[:, None])[:, 0]  # (T, R): one rope key shared by the heads
        out = self.attn(q_nope, q_pe, latent, k_pe)  # (T, H, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_head_dim))
