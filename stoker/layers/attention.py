"""Paged attention behind one interface; the backend is chosen once, when the model is built.

The runner sets an `AttentionMetadata` in each forward's context (layers/forward_context.py)
and binds each layer's slice of the KV cache (`Attention.k_cache`/`v_cache`); the model's
builder gives every layer its kernel set (`kernels`: Triton, the C kernels or the torch twins,
kernels/ops.py). Every layer then:
stores the step's new K/V through `slot_mapping`, and attends over each sequence's whole
context through its `block_table`. Sequences are ordered decodes first (one query token
each), so the decodes run as one batched paged-decode call and the rest (prefills, chunks,
extends after a prefix-cache hit) as one varlen paged-attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stoker.kernels import ops
from stoker.layers.forward_context import get_forward_context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    context_lens: torch.Tensor  # (B,) int32: cached + new tokens per sequence
    cu_seqlens_q: list[int]  # (B + 1,) offsets of each sequence's query tokens in T
    context_lens_list: list[int]

    num_decodes: int  # the first num_decodes sequences have exactly one query token
    # Device copies of the prefill part (sequences num_decodes..B), offsets rebased to 0,
    # so GPU kernels get them without a host-to-device copy per layer.
    prefill_cu_seqlens_q: torch.Tensor | None = None  # (B - num_decodes + 1,) int32
    _decode_views: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables, context_lens) of the decode rows, the same tensor objects for every
        layer of the step, so per-step plans built from them can be reused layer to layer."""
        if self._decode_views is None:
            nd = self.num_decodes
            self._decode_views = (self.block_tables[:nd], self.context_lens[:nd])
        return self._decode_views


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None,
        with_sinks: bool = False, logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        # Logit soft-capping (Gemma 2's attn_logit_softcapping): every score s -> cap x tanh(s / cap)
        # before the softmax; all three kernel sets take it. Passed to the kernels only when set,
        # so a layer without it calls them as before.
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"attn_logit_softcapping must be positive (or null: off), got {logits_soft_cap}")
        self.logits_soft_cap = logits_soft_cap
        self._soft_cap_kwargs: dict[str, float] = {"logits_soft_cap": logits_soft_cap} if logits_soft_cap else {}
        # Attention sinks (gpt-oss): a learned logit per head in the softmax's denominator, passed
        # to `forward` by the layer that holds them. The torch twins and the C kernels take them,
        # the Triton ones not yet: the builder binds the torch twins for such a layer on CUDA
        # (models/method_chooser.bind_kernels).
        self.with_sinks = with_sinks
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # (num_blocks, block_size, num_kv_heads, head_dim); bound by the runner.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # FP8 caches: the layer's K/V dequantization scales (x = e4m3 value * scale), from the
        # checkpoint where it has them (`checkpoint_kv_scales`), else 1.0. The runner resets
        # them to 1.0 for a float cache, where they mean nothing.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.checkpoint_kv_scales: dict[str, float] = {}
        self.kernels: ops.Kernels = ops.TORCH  # the builder binds the device's set (models/method_chooser.py)

    def set_checkpoint_kv_scale(self, which: str, value: float) -> None:
        """Record the checkpoint's k_scale / v_scale (models/loader.py); applied by the runner."""
        if which not in ("k_scale", "v_scale") or not value > 0:
            raise ValueError(f"{which} = {value}: a KV-cache scale must be k_scale or v_scale and positive")
        self.checkpoint_kv_scales[which] = value

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) for this step's tokens, sinks (H,) float32 when built
        `with_sinks` -> (T, H, D)."""
        md = get_forward_context().attn_metadata
        if md is None:
            raise RuntimeError("paged attention ran in a forward without AttentionMetadata")
        if (sinks is not None) != self.with_sinks:
            raise ValueError("attention sinks are given exactly when the layer was built with_sinks")
        kernels, cap = self.kernels, self._soft_cap_kwargs
        kv_scales = (self.k_scale, self.v_scale)
        kernels.store_kvcache(k, v, self.k_cache, self.v_cache, md.slot_mapping, *kv_scales)
        if sinks is not None:  # the last argument of the torch twins and the C kernels (Triton takes none)
            kv_scales = (*kv_scales, sinks)  # type: ignore[assignment]
        nd = md.num_decodes
        if nd == len(md.context_lens_list):  # pure decode step
            return kernels.paged_decode_attention(
                q, self.k_cache, self.v_cache, md.block_tables, md.context_lens, self.scale, self.sliding_window, *kv_scales,
                **cap,
            )
        if kernels.takes_device_lists and md.prefill_cu_seqlens_q is not None:
            cu_seqlens, context_lens = md.prefill_cu_seqlens_q, md.context_lens[nd:]
        else:  # the C kernel and the torch twin loop over sequences on the host: plain lists cost no syncs
            cu = md.cu_seqlens_q
            cu_seqlens, context_lens = [x - cu[nd] for x in cu[nd:]], md.context_lens_list[nd:]
        prefill = kernels.paged_attention(
            q[nd:], self.k_cache, self.v_cache, md.block_tables[nd:], cu_seqlens, context_lens, self.scale,
            self.sliding_window, *kv_scales, **cap,
        )  # fmt: skip
        if not nd:  # pure prefill: the kernel's output is the answer (no (T, H, D) copy)
            return prefill
        out = torch.empty_like(q)
        block_tables, decode_lens = md.decode_views()
        out[:nd] = kernels.paged_decode_attention(
            q[:nd], self.k_cache, self.v_cache, block_tables, decode_lens, self.scale, self.sliding_window, *kv_scales,
            **cap,
        )
        out[nd:] = prefill
        return out
