"""What a checkpoint folder is, read the way vLLM reads it. Pure Python (no torch).

The runner (generate or pooling) comes from config.json's `architectures` (vLLM's
`_get_default_runner_type`): an encoder (`BertModel`, `XLMRobertaModel`, `*Model`) or a
`*ForSequenceClassification` is a pooling model, a `*ForCausalLM` a generative one, except
that a folder in the sentence-transformers layout (a `modules.json` with a Pooling module) is
a pooling model whatever its architecture: Qwen3-Embedding ships `Qwen3ForCausalLM`.
`--runner pooling|generate` overrides the choice.

Pooling follows sentence-transformers' `1_Pooling/config.json` (both its old boolean form,
`pooling_mode_mean_tokens: true`, and the 6.x form, `pooling_mode: "mean"`) and the presence
of a `Normalize` module; without that file, vLLM's defaults: CLS for an encoder, the last
token for a decoder, normalized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RunnerKind = Literal["generate", "pooling"]
PoolingKind = Literal["embed", "classify"]
PoolingType = Literal["cls", "mean", "last"]

ENCODER_ARCHS = {"BertModel": "bert", "XLMRobertaModel": "xlm-roberta", "RobertaModel": "xlm-roberta"}
CLASSIFIER_ARCHS = {"BertForSequenceClassification": "bert"}  # XLM-R's head (dense + out_proj) is not built yet
DECODER_ARCHS = {"LlamaModel": "llama", "Qwen2Model": "qwen2", "Qwen3Model": "qwen3", "MistralModel": "mistral",
                 "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MistralForCausalLM": "mistral"}
_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_ST_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def _read_json(path: Path) -> dict[str, Any] | list[Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _st_modules(model_dir: Path) -> list[dict[str, Any]]:
    modules = _read_json(model_dir / "modules.json")
    return modules if isinstance(modules, list) else []


def _module_of(modules: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The first module whose type ends with `kind` (sentence_transformers...Pooling)."""
    return next((m for m in modules if str(m.get("type", "")).rsplit(".", 1)[-1] == kind), None)


def has_st_pooling(model_dir: str | Path) -> bool:
    return _module_of(_st_modules(Path(model_dir)), "Pooling") is not None


def resolve_runner(model_dir: str | Path, runner: str = "auto") -> RunnerKind:
    """`--runner auto|generate|pooling` for the folder (see the module docstring)."""
    if runner in ("generate", "pooling"):
        return runner  # type: ignore[return-value]
    if runner != "auto":
        raise ValueError(f"--runner must be auto, generate or pooling, got {runner!r}")
    cfg = _read_json(Path(model_dir) / "config.json") or {}
    archs = list(cfg.get("architectures") or []) if isinstance(cfg, dict) else []
    if has_st_pooling(model_dir):
        return "pooling"
    for arch in archs:
        if arch in ENCODER_ARCHS or arch in CLASSIFIER_ARCHS or arch.endswith(("ForSequenceClassification", "EmbeddingModel")):
            return "pooling"
        if arch.endswith("ForCausalLM"):
            return "generate"
        if arch.endswith("Model"):
            return "pooling"  # vLLM's suffix default: a bare *Model is a pooling model
    return "generate"


@dataclass(frozen=True)
class PoolingConfig:
    """A pooling model as served: what it computes and the limits a request is held to."""

    architecture: str
    family: str  # bert | xlm-roberta | llama | qwen2 | qwen3 | mistral
    kind: PoolingKind  # embed: a vector per input; classify: a score per (query, document) pair
    pooling: PoolingType
    normalize: bool
    max_model_len: int
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_labels: int = 0
    # RoBERTa numbers positions from padding_idx + 1 (a 514-row table serves 512 tokens); BERT from 0.
    position_offset: int = 0

    def __post_init__(self) -> None:
        if self.kind == "classify" and self.num_labels != 1:
            raise ValueError(f"a reranker (cross-encoder) must have num_labels 1 (one relevance score), got {self.num_labels}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def is_encoder(self) -> bool:
        return self.family in ("bert", "xlm-roberta")


def _pooling_from_st(model_dir: Path, modules: list[dict[str, Any]]) -> PoolingType | None:
    module = _module_of(modules, "Pooling")
    if module is None:
        return None
    cfg = _read_json(model_dir / module.get("path", "") / "config.json")
    if not isinstance(cfg, dict):
        raise ValueError(f"{model_dir}: modules.json names a Pooling module but {module.get('path')}/config.json is missing")
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    elif isinstance(mode, list):
        modes = mode
    else:
        modes = [m for flag, m in _ST_FLAGS.items() if cfg.get(flag)]
        modes += [flag for flag in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                     "pooling_mode_weightedmean_tokens") if cfg.get(flag)]
    named = [_ST_MODES.get(m, m) for m in modes]
    if len(named) != 1 or named[0] not in ("cls", "mean", "last"):
        raise ValueError(f"{model_dir}: pooling {modes} is not supported; supported: one of cls, mean, lasttoken")
    unsupported = [m.get("type") for m in modules if str(m.get("type", "")).rsplit(".", 1)[-1] not in
                   ("Transformer", "Pooling", "Normalize")]
    if unsupported:
        raise ValueError(f"{model_dir}: sentence-transformers modules {unsupported} are not supported "
                         "(supported: Transformer, Pooling, Normalize)")
    return named[0]  # type: ignore[return-value]


def read_pooling_config(model_dir: str | Path, max_model_len: int | None = None) -> PoolingConfig:
    """The folder's pooling model; ValueError naming what is not supported."""
    path = Path(model_dir)
    cfg = _read_json(path / "config.json")
    if not isinstance(cfg, dict):
        raise FileNotFoundError(f"{path / 'config.json'} is missing: a checkpoint folder needs config.json")
    archs = list(cfg.get("architectures") or [])
    arch = next((a for a in archs if a in ENCODER_ARCHS or a in CLASSIFIER_ARCHS or a in DECODER_ARCHS), None)
    if arch is None:
        known = sorted({*ENCODER_ARCHS, *CLASSIFIER_ARCHS, *DECODER_ARCHS})
        raise ValueError(f"architecture {archs!r} is not supported as a pooling model; supported: {', '.join(known)}")
    modules = _st_modules(path)
    st_pooling = _pooling_from_st(path, modules)
    kind: PoolingKind = "classify" if arch in CLASSIFIER_ARCHS else "embed"
    family = {**ENCODER_ARCHS, **CLASSIFIER_ARCHS, **DECODER_ARCHS}[arch]
    is_encoder = family in ("bert", "xlm-roberta")
    if kind == "classify":
        pooling, normalize = "cls", False  # BERT's pooler reads [CLS]; the score is sigmoid(logit)
    else:
        pooling = st_pooling or ("cls" if is_encoder else "last")
        normalize = _module_of(modules, "Normalize") is not None if st_pooling else True
    pad = cfg.get("pad_token_id")
    offset = (1 if pad is None else int(pad)) + 1 if family == "xlm-roberta" else 0
    positions = int(cfg.get("max_position_embeddings") or 512) - offset
    limits = [positions]
    st_cfg = _read_json(path / "sentence_bert_config.json")
    if isinstance(st_cfg, dict) and st_cfg.get("max_seq_length"):
        limits.append(int(st_cfg["max_seq_length"]))
    if max_model_len is not None:
        if max_model_len > positions:
            raise ValueError(f"--max-model-len {max_model_len} is longer than the model's {positions} positions")
        limits = [max_model_len]
    dims = cfg.get("matryoshka_dimensions")
    return PoolingConfig(
        architecture=arch, family=family, kind=kind, pooling=pooling, normalize=normalize,  # type: ignore[arg-type]
        max_model_len=min(limits), hidden_size=int(cfg["hidden_size"]),
        is_matryoshka=bool(cfg.get("is_matryoshka")) or dims is not None,
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        num_labels=int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 1) if kind == "classify" else 0,
        position_offset=offset,
    )
