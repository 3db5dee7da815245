"""The drafter a speculative config names, built once with the runner: a draft model
(spec_decode/drafter.py) or an EAGLE-3 head (spec_decode/eagle3.py), which builds on the former."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from stoker.config import EngineConfig
from stoker.spec_decode.draft_cache import DraftKVCache
from stoker.spec_decode.drafter import DraftModelDrafter, Drafter
from stoker.spec_decode.eagle3 import make_eagle3_drafter

logger = logging.getLogger(__name__)


def make_drafter(config: EngineConfig, target: nn.Module, target_cfg: dict[str, Any], max_model_len: int,
                 device: torch.device, dtype: torch.dtype) -> Drafter:
    """The drafter `config.speculative_config` names, its weights loaded (TP 1: the config refuses more)."""
    from stoker.models.loader import build_model, load_weights, read_hf_config
    from stoker.quantization import config as quant_config
    from stoker.quantization import gguf as gguf_quant

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    if spec.method == "eagle3":
        return make_eagle3_drafter(config, target, target_cfg, max_model_len, device, dtype)
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
    model = build_model(draft_cfg, max_model_len, dtype, device, quant)
    load_weights(model, spec.model)
    cache = DraftKVCache(model.attention_layers(), model.kv_cache_spec(str(dtype).removeprefix("torch.")),
                         config.cache_config.block_size, spec.num_speculative_tokens,
                         config.scheduler_config.max_num_seqs, dtype, device)
    logger.info("draft model %s: %d layers, %s per KV block", spec.model, draft_cfg["num_hidden_layers"],
                f"{cache.bytes_per_block / 2**10:.1f} KiB")
    return DraftModelDrafter(config, model, cache, max_model_len, device)
