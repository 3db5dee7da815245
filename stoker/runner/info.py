"""What a runner is, as plain values: asked through the executor contract (`describe`), read
by the engine's start-up log and the server's wall model. [no torch]"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.config import KVCacheSpec


@dataclass(frozen=True)
class RunnerInfo:
    """What rank 0's runner is, as plain values (for the engine's log, the server's wall model)."""

    device: str  # "cpu", "cuda:0"
    device_name: str  # torch's name of a CUDA device ("NVIDIA H100 80GB HBM3"); "cpu" on a CPU
    dtype: str  # the model's activation dtype: "float32", "bfloat16", "float16"
    quantization: str | None  # the projections' method ("fp8", "int8"), None for float weights
    kv_spec: KVCacheSpec  # one token of this rank's KV cache
    bytes_per_block: int
    weights_summary: str  # predicted vs held weight bytes, for the start-up log
    # LoRA: the (layer, projection) pairs with slots, and the layers whose MLP is a
    # Mixture-of-Experts block (no slots there), so an adapter is checked when it is registered
    lora_targets: frozenset[tuple[int, str]] | None = None
    moe_layers: frozenset[int] = frozenset()

    @property
    def device_type(self) -> str:
        return self.device.partition(":")[0]
