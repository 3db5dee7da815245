"""The drafter a speculative config names, built once with the runner: a draft model
(spec_decode/drafter.py) or an EAGLE-3 head (spec_decode/eagle3.py), which builds on the former.

Under tensor parallelism the draft is sharded over the target's group by default (vLLM's
default, draft_tensor_parallel_size = the target's): each rank holds its share of the draft's
weights and of its KV heads, so a KV block costs every rank the same bytes (the block budget is
the smallest rank's), and an EAGLE-3 head reads the target's vocab-parallel embedding, a
collective, anyway. draft_tensor_parallel_size 1 replicates it instead: every rank holds the whole
draft and its whole KV cache and computes the same drafts with no collective in its layers
(for a draft of a few layers, the per-layer all-reduces can cost more than the GEMMs they
split), at TP times the draft's bytes. Either way every rank runs the draft loop in lockstep
and rank 0's proposals are the ones kept (spec_decode/drafter.py)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from stoker.config import EngineConfig
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.spec_decode.draft_cache import DraftKVCache
from stoker.spec_decode.drafter import DraftModelDrafter, Drafter
from stoker.spec_decode.eagle3 import make_eagle3_drafter

logger = logging.getLogger(__name__)


def make_drafter(config: EngineConfig, target: nn.Module, target_cfg: dict[str, Any], max_model_len: int,
                 device: torch.device, dtype: torch.dtype, tp: TensorParallelGroup | None = None) -> Drafter:
    """The drafter `config.speculative_config` names, its weights loaded: this rank's shard, or
    the whole draft when draft_tensor_parallel_size is 1 (`tp`: the target's group)."""
    from stoker.models.loader import build_model, load_weights, read_hf_config
    from stoker.quantization import config as quant_config
    from stoker.quantization import gguf as gguf_quant

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    tp = tp or TensorParallelGroup.single()
    draft_tp = TensorParallelGroup.single() if spec.draft_tensor_parallel_size == 1 else tp
    if tp.world_size > 1:
        logger.info("%s %s: %s over the %d tensor-parallel ranks", spec.method, spec.model,
                    "whole on each" if draft_tp.world_size == 1 else "sharded", tp.world_size)
    if spec.method == "eagle3":
        return make_eagle3_drafter(config, target, target_cfg, max_model_len, device, dtype, tp, draft_tp)
    draft_cfg = read_hf_config(spec.model)
    if int(draft_cfg["vocab_size"]) != int(target_cfg["vocab_size"]):
        raise ValueError(f"speculative_config model {spec.model} has vocab_size {draft_cfg['vocab_size']}, the target "
                         f"{target_cfg['vocab_size']}: a draft model must share the target's tokenizer and vocabulary")
    limit = draft_cfg.get("max_position_embeddings")
    if limit is not None and int(limit) < max_model_len:  # still lossless: its drafts just get worse there
        logger.warning("draft model %s was made for %d positions, the target serves %d", spec.model, limit, max_model_len)
    # its own representation, decided as the target's is (a GGUF file: a scheme per tensor type)
    quant = (gguf_quant.resolve(draft_cfg, None) if draft_cfg.get("gguf_architecture")
             else quant_config.resolve(draft_cfg, None))
    model = build_model(draft_cfg, max_model_len, dtype, device, quant, draft_tp)
    load_weights(model, spec.model)
    cache = DraftKVCache(model.attention_layers(), model.kv_cache_spec(str(dtype).removeprefix("torch.")),
                         config.cache_config.block_size, spec.num_speculative_tokens,
                         config.scheduler_config.max_num_seqs, dtype, device)
    logger.info("draft model %s: %d layers, %s per KV block", spec.model, draft_cfg["num_hidden_layers"],
                f"{cache.bytes_per_block / 2**10:.1f} KiB")
    return DraftModelDrafter(config, model, cache, max_model_len, device, tp)
