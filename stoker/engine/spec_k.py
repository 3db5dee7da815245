"""The engine's side of k chosen by the wall (core/spec_k_policy.py): the cost model it prices
steps with, and the cut of each step's proposals to the chosen k.

The cost model is the one the live wall verdict uses (engine/wall_model.py): on a GPU the
hardware table's entry for the device and the "engine" efficiency profile; on a CPU the device
file `stoker doctor --device cpu --write-device-file` measured. Without either, k stays fixed
(the log says so and how to get one): a guess at this machine's roofs would decide nothing real.

A draft model or an EAGLE-3 head is priced by the same wall model built over its own config
(`draft_config`), so the policy weighs its forwards against what they save; its k is chosen from
what each decoding sequence may propose (the runner proposes after the step) and sent to the
runner in the step message (`StepMessage.num_speculative_tokens`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from stoker.core.spec_k_policy import PlannedSeq, SpecKPolicy

if TYPE_CHECKING:
    from stoker.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def build_k_policy(engine: LLMEngine) -> SpecKPolicy | None:
    """The policy for a speculating engine with `"dynamic": true`; None with `false`."""
    spec = engine.config.speculative_config
    if spec is None or not spec.dynamic:
        return None
    from stoker.engine.info import EngineInfo
    from stoker.engine.wall_model import build_wall_model

    cfg = engine.config
    info = EngineInfo(model_path=cfg.model_config.model, hf_config=engine.hf_config, max_model_len=engine.max_model_len,
                      vocab_size=engine.input_limits.vocab_size, max_num_seqs=cfg.scheduler_config.max_num_seqs,
                      max_loras=None, cache_config=cfg.cache_config,
                      tensor_parallel_size=cfg.parallel_config.tensor_parallel_size, runner=engine.runner_info)
    try:
        wall = build_wall_model(info)
    except (KeyError, ValueError) as exc:  # a model the roofline cannot describe
        wall, reason = None, str(exc)
    else:
        reason = "no cost model for this device (on a CPU: `stoker doctor --device cpu --write-device-file`)"
    if wall is None:
        logger.warning("speculative decoding: k fixed at %d, not chosen per step: %s", spec.num_speculative_tokens, reason)
        return SpecKPolicy(spec.num_speculative_tokens, None)
    draft_price = None
    if spec.drafts_in_runner:
        import dataclasses

        draft_tp = spec.draft_tensor_parallel_size or cfg.parallel_config.tensor_parallel_size
        draft_info = dataclasses.replace(info, model_path=str(spec.model), hf_config=draft_config(spec.method, str(spec.model)),
                                         tensor_parallel_size=draft_tp)
        try:
            draft_wall = build_wall_model(draft_info)
        except (KeyError, ValueError) as exc:
            logger.warning("speculative decoding: k fixed at %d, not chosen per step: the draft %s cannot be "
                           "priced (%s)", spec.num_speculative_tokens, spec.model, exc)
            return SpecKPolicy(spec.num_speculative_tokens, None)
        assert draft_wall is not None  # the same device as the target's, which was described
        draft_price = lambda shape: draft_wall.judge(shape, 0.0).predicted_s  # noqa: E731
    logger.info("speculative decoding: k (at most %d) chosen per step by the cost model of %s%s",
                spec.num_speculative_tokens, wall.describe(), ", the draft's forwards priced too" if draft_price else "")
    return SpecKPolicy(spec.num_speculative_tokens, lambda shape: wall.judge(shape, 0.0).predicted_s, draft_price)


def draft_config(method: str, folder: str) -> dict[str, Any]:
    """The config the roofline prices one draft forward by: a draft model's own; for an EAGLE-3
    head its one decoder layer with its LM head over the draft vocabulary (the fc combining the
    target's three hidden states, 3 x hidden^2 weights, is left out: a few percent of the head)."""
    if method != "eagle3":
        from stoker.models.loader import read_hf_config

        return read_hf_config(folder)
    from stoker.spec_decode.eagle3 import read_head_config

    cfg = read_head_config(folder)  # its architecture is a head's, which the model registry does not build
    return {**cfg, "vocab_size": int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), "tie_word_embeddings": False}


def cut_drafts(engine: LLMEngine, policy: SpecKPolicy, wanted: dict[int, int] | None = None) -> int | None:
    """Ask the policy for this step's k and cut every proposal to it. The step also computes the
    running prompts' next chunks (their uncomputed tokens, within the token budget). `wanted`:
    seq_id -> the proposals a sequence may get when the runner makes them after this step (the k
    chosen here caps them, `StepMessage.num_speculative_tokens`); None: the proposals at hand.
    -> the k chosen, None when no sequence decodes (nothing to choose for)."""
    decoding = [s for s in engine.scheduler.running if s.num_uncomputed_tokens == 1 and s.num_output_tokens > 0]
    planned = [PlannedSeq(s.num_tokens, wanted.get(s.seq_id, 0) if wanted is not None else len(s.draft_token_ids))
               for s in decoding]
    if not any(p.num_drafts for p in planned):
        return None
    budget = engine.max_num_batched_tokens - len(planned)
    prefill = attended = 0
    for s in engine.scheduler.running:
        if s.is_prefill and budget > 0:
            n = min(s.num_uncomputed_tokens, budget)
            budget -= n
            prefill += n
            attended += n * s.num_computed_tokens + n * (n + 1) // 2
    k = policy.choose(planned, prefill, attended)
    for s in decoding:
        if len(s.draft_token_ids) > k:
            s.draft_token_ids = s.draft_token_ids[:k]
    return k
