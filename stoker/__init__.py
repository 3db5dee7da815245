"""Stoker: an LLM inference-serving stack that keeps the accelerator fed.

The public names are imported lazily so that the pure-Python parts of the package
(`stoker.core`, `stoker.roofline`, `stoker.fleet`, ...) can be used without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "LoRARequest", "__version__"]

_LAZY = {
    "LLM": ("stoker.engine.llm", "LLM"),
    "SamplingParams": ("stoker.sampling_params", "SamplingParams"),
    "EngineConfig": ("stoker.config", "EngineConfig"),
    "RequestOutput": ("stoker.outputs", "RequestOutput"),
    "CompletionOutput": ("stoker.outputs", "CompletionOutput"),
    "LoRARequest": ("stoker.lora.request", "LoRARequest"),
}

if TYPE_CHECKING:  # pragma: no cover
    from stoker.config import EngineConfig
    from stoker.engine.llm import LLM
    from stoker.lora.request import LoRARequest
    from stoker.outputs import CompletionOutput, RequestOutput
    from stoker.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'stoker' has no attribute {name!r}")
