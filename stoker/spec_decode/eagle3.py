"""method "eagle3": an EAGLE-3 head (models/eagle3.py) drafting from the target's hidden states.

Row p of the head reads the target's low/mid/high hidden states at p (fc-combined) and the token
at p + 1, and predicts the token at p + 2. So its catch-up over a step that kept positions
[s, s + m) of the target is m rows: the target's rows s..s+m-1 with the tokens one to the right
(the step's known tokens after the first, the accepted drafts, the new token); the last row
proposes the first draft. Later rows feed the head's own pre-norm output back as the hidden
input, one draft token each (vLLM's EAGLE proposer does the same).

The hidden states are caught by forward pre-hooks on three target layers (the residual stream
entering layer j), so the target's code is untouched; the hooks see eager forwards only, so the
target's CUDA graphs stay off with this method. Under tensor parallelism each rank's taps are
already the whole states, no gather needed: the stream between layers is replicated (each
row-parallel projection all-reduces its partial sums before the residual add, the
vocab-parallel embedding all-reduces its rows), so every rank combines the same (T, 3 x hidden). A prompt chunk that does not sample cannot run
its last row yet (the token after it is in the next chunk): that row's hidden state is carried
to the sequence's next step. After a prefix-cache hit the head's K/V at the hit's last position
came from the sequence that computed it (whose next token may differ): that only makes a draft
worse, never the output (the rejection sampler decides).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from stoker.config import EngineConfig
from stoker.core.step import SeqStep, StepMessage
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.forward_context import ForwardContext, set_forward_context
from stoker.layers.rotary import rope_parameters
from stoker.models.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Head, aux_layer_ids
from stoker.runner.inputs import ModelInputs
from stoker.spec_decode.draft_cache import DraftKVCache
from stoker.spec_decode.drafter import Drafter, DraftRows, Kept

logger = logging.getLogger(__name__)


class AuxHiddenStates:
    """The residual stream entering each of three target layers, caught on every target forward:
    `combined()` -> (T, 3 x hidden) low|mid|high for the last forward's T tokens."""

    def __init__(self, layers: nn.ModuleList, layer_ids: tuple[int, ...]) -> None:
        self.layer_ids = layer_ids
        self.states: dict[int, torch.Tensor] = {}
        self.handles = [layers[j].register_forward_pre_hook(self._hook(j)) for j in layer_ids]

    def _hook(self, j: int) -> Any:
        def catch(module: nn.Module, args: tuple[Any, ...]) -> None:
            _, hidden, residual = args[:3]  # a decoder layer's (positions, hidden, residual)
            # a copy: the layer's fused add-norm may update its residual in place
            self.states[j] = hidden.clone() if residual is None else hidden + residual

        return catch

    def combined(self) -> torch.Tensor:
        return torch.cat([self.states[j] for j in self.layer_ids], dim=-1)


class Eagle3Drafter(Drafter):
    target_graphs_ok = False  # the pre-hooks must see every target forward
    # The head's row p needs the target's hidden states at p, caught only in the step that computed
    # p: at k = 0 it keeps catching up (one decoder layer over the step's rows, no LM head, no
    # proposal) rather than hold those states per skipped token (hidden_size values each, for as
    # long as k stays 0) or leave holes in its cache that every later draft would attend
    defers_catch_up = False

    def __init__(self, config: EngineConfig, head: Eagle3Head, embedding: nn.Module, aux: AuxHiddenStates,
                 cache: DraftKVCache, max_model_len: int, device: torch.device,
                 tp: TensorParallelGroup | None = None, target_vocab_size: int | None = None) -> None:
        super().__init__(config, cache, max_model_len, device, tp)
        self.head, self.embedding, self.aux = head, embedding, aux
        self.target_vocab_size = target_vocab_size or head.draft_vocab_size  # the ids a grammar's bitmask spans
        # seq_id -> (position, (hidden,) combined target state) of a chunk's last row, run next step
        self.carry: dict[int, tuple[int, torch.Tensor]] = {}

    def catch_up_rows(self, step: StepMessage, inputs: ModelInputs, kept: dict[int, Kept]) -> list[DraftRows]:
        combined = self.head.combine(self.aux.combined())  # (T, hidden), rows in the step's order
        cu = inputs.attn_metadata.cu_seqlens_q
        plans = []
        for i, s in enumerate(step.seqs):
            known = s.num_tokens - len(s.draft_token_ids)
            rows = combined[cu[i] : cu[i] + s.num_tokens]  # (n, hidden)
            carried = self.carry.pop(s.seq_id, None)
            got = kept.get(s.seq_id) if s.do_sample else None
            if got is not None:
                tokens = s.token_ids[1:known] + got.token_ids  # the token one to the right of each kept row
                hidden = rows[: len(tokens)]
                num = got.num_drafts
            else:  # a chunk's last row waits for the next chunk's first token
                tokens, hidden, num = s.token_ids[1:], rows[: s.num_tokens - 1], 0
                self.carry[s.seq_id] = (s.start_pos + s.num_tokens - 1, rows[-1:].clone())
            start = s.start_pos
            if carried is not None and carried[0] == start - 1:
                tokens, hidden, start = [s.token_ids[0], *tokens], torch.cat([carried[1], hidden]), start - 1
            plans.append(DraftRows(s.seq_id, tokens, start, s.block_table, num, hidden))
        return plans

    def run(self, seqs: list[SeqStep], hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert hidden is not None
        inputs = self.forward_inputs(seqs)
        with set_forward_context(ForwardContext(inputs.attn_metadata)):
            embeds = self.embedding(inputs.input_ids)  # (T, hidden)
            normed, prenorm = self.head(inputs.positions, embeds, hidden)
        if not inputs.sampled:
            return torch.empty(0, dtype=torch.int64), None
        idx = inputs.logits_indices
        if self.draft_mask is None:
            return self.head.draft_token_ids(normed[idx]), prenorm[idx]
        # Sequences with a grammar: the head's argmax within it, as a draft model's (Drafter.greedy):
        # its logits spread over the target's ids, where the grammar's bitmask applies
        return self.greedy(inputs, self.head.target_logits(normed[idx], self.target_vocab_size)), prenorm[idx]

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.carry.pop(seq_id, None)


def read_head_config(folder: str) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"speculative_config model {folder}: no config.json (an EAGLE-3 head folder has one)")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    if not set(archs) & set(EAGLE3_ARCHITECTURES):
        raise ValueError(f"speculative_config model {folder} is not an EAGLE-3 head: architectures {archs}, "
                         f"expected one of {', '.join(EAGLE3_ARCHITECTURES)}")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE-3 head {folder} has num_hidden_layers {cfg['num_hidden_layers']}; only one-layer "
                         f"heads (the published layout) are supported")
    rope_parameters(cfg)
    return cfg


@contextlib.contextmanager
def _safetensors_folder(folder: str) -> Iterator[str]:
    """`folder`, or, when it holds only `pytorch_model.bin` (as the original EAGLE-3 releases
    do), a temporary copy of its tensors as safetensors (read with weights_only: no code runs),
    removed once loaded."""
    bin_file = Path(folder) / "pytorch_model.bin"
    if list(Path(folder).glob("*.safetensors")) or not bin_file.is_file():
        yield folder
        return
    from safetensors.torch import save_file

    tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
    with tempfile.TemporaryDirectory(prefix="stoker-eagle3-") as tmp:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(Path(tmp) / "model.safetensors"))
        del tensors
        yield tmp


def _tensor_names(folder: str) -> list[str]:
    from stoker.models.loader import safetensors_files

    names = []
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as st:
            names.extend(st.keys())
    return names


def _load_vocab_map(head: Eagle3Head, folder: str, target_vocab: int) -> None:
    """d2t: (draft_vocab,) offsets, draft id i -> target id i + d2t[i]; absent: the same vocabulary."""
    from stoker.models.loader import safetensors_files

    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as st:
            if "d2t" in st.keys():
                d2t = st.get_tensor("d2t").to(torch.int64)
                if tuple(d2t.shape) != (head.draft_vocab_size,):
                    raise ValueError(f"EAGLE-3 head {folder}: d2t has shape {tuple(d2t.shape)}, "
                                     f"expected ({head.draft_vocab_size},) = draft_vocab_size")
                targets = torch.arange(head.draft_vocab_size) + d2t
                if int(targets.min()) < 0 or int(targets.max()) >= target_vocab:
                    raise ValueError(f"EAGLE-3 head {folder}: d2t maps draft ids outside the target vocabulary "
                                     f"[0, {target_vocab})")
                head.d2t.copy_(d2t)
                return
    if head.draft_vocab_size != target_vocab:
        raise ValueError(f"EAGLE-3 head {folder} has draft_vocab_size {head.draft_vocab_size} != the target's "
                         f"vocab_size {target_vocab} and no d2t map")


def make_eagle3_drafter(config: EngineConfig, target: nn.Module, target_cfg: dict[str, Any], max_model_len: int,
                        device: torch.device, dtype: torch.dtype, tp: TensorParallelGroup,
                        head_tp: TensorParallelGroup) -> Eagle3Drafter:
    """The head built over `head_tp` (the target's group: sharded; a single group: whole on every
    rank), drafting in lockstep on every rank of `tp` (the target's)."""
    from stoker.models.loader import build_with_methods, load_weights

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    folder = spec.model
    cfg = read_head_config(folder)
    hidden, target_hidden = int(cfg["hidden_size"]), int(target_cfg["hidden_size"])
    if int(cfg.get("target_hidden_size") or hidden) != target_hidden:
        raise ValueError(f"EAGLE-3 head {folder} reads hidden states of size {cfg.get('target_hidden_size') or hidden}; "
                         f"the target's hidden_size is {target_hidden}")
    if int(cfg["vocab_size"]) != int(target_cfg["vocab_size"]):
        raise ValueError(f"EAGLE-3 head {folder} has vocab_size {cfg['vocab_size']}, the target "
                         f"{target_cfg['vocab_size']}: the head must share the target's tokenizer and vocabulary")
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"EAGLE-3 needs a decoder-layer stack in the target; {type(target).__name__} has none")
    ids = aux_layer_ids(cfg, len(layers))
    with _safetensors_folder(folder) as weights:
        has_embedding = "embed_tokens.weight" in _tensor_names(weights)
        if not has_embedding and hidden != target_hidden:
            raise ValueError(f"EAGLE-3 head {folder} has no embed_tokens and hidden_size {hidden} != the target's "
                             f"{target_hidden}: it cannot share the target's embedding")
        head = build_with_methods(lambda: Eagle3Head(cfg, max_model_len, head_tp, has_embedding), dtype, device,
                                  what="EAGLE-3 head")
        load_weights(head, weights)
        _load_vocab_map(head, weights, int(target_cfg["vocab_size"]))
    embedding = head.embed_tokens if has_embedding else target.model.embed_tokens
    cache = DraftKVCache(head.attention_layers(), head.kv_cache_spec(str(dtype).removeprefix("torch.")),
                         config.cache_config.block_size, spec.num_speculative_tokens,
                         config.scheduler_config.max_num_seqs, dtype, device)
    logger.info("EAGLE-3 head %s: target layers %s feed it, draft vocabulary %d of %d", folder, list(ids),
                head.draft_vocab_size, target_cfg["vocab_size"])
    return Eagle3Drafter(config, head, embedding, AuxHiddenStates(layers, ids), cache, max_model_len, device, tp,
                         int(target_cfg["vocab_size"]))
