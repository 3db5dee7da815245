"""Which adapter a request runs with, as vLLM's offline API names it. [no torch]"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int = 0  # vLLM's; unused here (the name identifies the adapter)
    lora_path: str = ""
