"""One forward's context: what the layers read that belongs to this forward, not to the model.

The runner builds one `ForwardContext` per forward and sets it for the forward's duration
(`set_forward_context`, as nano-vllm's `set_context` and vLLM's `set_forward_context`); layers
read it with `get_forward_context()`. Nothing else per forward is global (DESIGN.md, seam 20):

  * `attn_metadata`: the paged attention's slot mapping, block tables and lengths (generative
    runner, runner/inputs.py; a CUDA graph's static buffers while it is captured);
  * `lora_mapping`: which tokens run on which LoRA slot (None: every token on the base model);
  * `varlen`: a pooling model's packed batch of whole sequences (pooling/attention.py);
  * `kv_connector_meta`: a KV connector's per-step metadata (StepMessage.kv_connector_meta).

Thread-local: the generative engine thread and the pooling models' instance threads each run
their own forwards at the same time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.layers.attention import AttentionMetadata
    from stoker.layers.lora import LoRAMapping
    from stoker.pooling.attention import VarlenBatch


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None = None
    lora_mapping: LoRAMapping | None = None
    varlen: VarlenBatch | None = None
    kv_connector_meta: Any = None


_local = threading.local()


@contextlib.contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """`context` is this thread's for the block (the previous one comes back after it)."""
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("a layer ran outside a runner's forward (no ForwardContext is set)")
    return context
