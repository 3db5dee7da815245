"""Which LoRA adapters the engine knows (host memory) and which sit in the compute slots.

Adapters are registered by name (at start-up from --lora-modules, or while serving through
/v1/load_lora_adapter) and held on the host. Before each step the engine asks for slots for
the step's adapters: one already in a slot stays; another takes a free slot or the least
recently used one that no sequence of this step needs (the scheduler never lets a step hold
more adapters than slots). Unloading marks an adapter gone for new requests; it is dropped once
no sequence uses it (requests in flight finish first).

Registration happens on server threads, slots on the engine thread: one lock guards the maps.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from typing import Any

from stoker.config import LoRAConfig
from stoker.lora.adapter import LoRAAdapter, LoRAError, check_served, load_adapter


class LoRAManager:
    def __init__(self, config: LoRAConfig, hf_config: dict[str, Any], model_path: str, executor: Any,
                 targets: frozenset[tuple[int, str]] | None = None, moe_layers: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.targets = targets  # (layer, projection) pairs the runner holds slots for (RunnerInfo)
        self.moe_layers = moe_layers
        self.hf_config = hf_config
        self.model_path = model_path
        self.executor = executor
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRAAdapter] = {}
        self._unloading: set[str] = set()
        self._slots: list[str | None] = [None] * config.max_loras
        self._lru: collections.OrderedDict[str, None] = collections.OrderedDict()  # slotted adapters, oldest first

    # ------------------------------------------------------------------ registry (any thread)
    def read(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter (slow: disk); add() it after. An adapter with weights for a
        projection the model has no slot for (a Mixture-of-Experts layer's experts) is refused here."""
        adapter = load_adapter(name, path, self.hf_config, self.config.max_lora_rank, self.model_path)
        if self.targets is not None:
            check_served(adapter, self.targets, self.moe_layers)
        return adapter

    def add(self, adapter: LoRAAdapter) -> None:
        with self._lock:
            if adapter.name in self._adapters:
                raise LoRAError(f"a LoRA adapter named {adapter.name!r} is already loaded; unload it first or use "
                                "another name")
            self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """New requests may no longer name it; it goes once its requests have finished."""
        with self._lock:
            if name not in self._adapters or name in self._unloading:
                raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
            self._unloading.add(name)

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters and name not in self._unloading

    def names(self) -> list[str]:
        with self._lock:
            return [n for n in self._adapters if n not in self._unloading]

    def path_of(self, name: str) -> str:
        with self._lock:
            return self._adapters[name].path

    # ------------------------------------------------------------------ slots (engine thread)
    def slots_for(self, names: set[str]) -> dict[str, int]:
        """A compute slot for each adapter of the step, loading the ones not in a slot."""
        out: dict[str, int] = {}
        with self._lock:
            for name in sorted(names):
                if name in self._slots:
                    slot = self._slots.index(name)
                else:
                    slot = self._free_slot(names)
                    self.executor.load_lora(slot, self._adapters[name])
                    if self._slots[slot] is not None:
                        self._lru.pop(self._slots[slot], None)
                    self._slots[slot] = name
                self._lru[name] = None
                self._lru.move_to_end(name)
                out[name] = slot
        return out

    def _free_slot(self, needed: set[str]) -> int:
        if None in self._slots:
            return self._slots.index(None)
        for name in self._lru:  # least recently used first
            if name not in needed:
                return self._slots.index(name)
        raise RuntimeError(f"a step needs {len(needed)} LoRA adapters but only {len(self._slots)} slots exist "
                           "(the scheduler should have held some back)")

    def collect_unloaded(self, in_use: Iterable[str]) -> None:
        """Drop the adapters being unloaded that no sequence uses any more."""
        busy = set(in_use)
        with self._lock:
            for name in [n for n in self._unloading if n not in busy]:
                self._unloading.discard(name)
                self._adapters.pop(name, None)
                if name in self._slots:
                    slot = self._slots.index(name)
                    self._slots[slot] = None
                    self._lru.pop(name, None)
                    self.executor.clear_lora(slot)

    def slotted(self) -> list[str]:
        with self._lock:
            return [n for n in self._slots if n is not None]
