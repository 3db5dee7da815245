"""Executes one scheduler step: inputs -> forward over the packed batch -> logits -> tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from stoker import cpu_runtime
from stoker.config import EngineConfig
from stoker.core.scheduler import SchedulerOutput
from stoker.layers.attention import set_attention_metadata
from stoker.kernels._common import FP8_KV_DTYPE
from stoker.models.loader import build_model, load_weights
from stoker.quantization import config as quant_config
from stoker.runner import memory
from stoker.runner.cuda_graph import CudaGraphRunner, graphs_supported
from stoker.runner.inputs import prepare_inputs
from stoker.sampling.sampler import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available; use device='cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU; bfloat16 on CUDA, float16 where bf16 is unsupported."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


@dataclass
class StepResult:
    seq_ids: list[int]  # sequences that sampled, in row order
    sampler_output: SamplerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: dict[str, Any], max_model_len: int) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device)
        self.block_size = config.cache_config.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(config.model_config.seed)
        max_position = max(max_model_len, hf_config.get("max_position_embeddings", max_model_len))
        # Quantization is decided once, before any parameter exists (an unsupported scheme is
        # refused here, before a tensor is read); each projection's method follows from it.
        self.quant = quant_config.resolve(hf_config, config.model_config.quantization)
        if self.device.type == "cpu":
            logger.info("%s", cpu_runtime.describe())
        self.model = build_model(hf_config, max_position, self.dtype, self.device, self.quant)
        load_weights(self.model, config.model_config.model)
        self.sampler = Sampler(config.model_config.seed, self.device)
        self.generators: dict[int, torch.Generator] = {}
        cache = config.cache_config
        self.kv_dtype = FP8_KV_DTYPE if cache.fp8_kv else self.dtype
        self.kv_spec = self.model.kv_cache_spec("fp8_e4m3" if cache.fp8_kv else str(self.dtype).removeprefix("torch."))
        self._apply_kv_scales(cache.fp8_kv)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graph_runner: CudaGraphRunner | None = None  # set by capture_cuda_graphs

    # ------------------------------------------------------------------ KV cache
    def _apply_kv_scales(self, fp8: bool) -> None:
        """FP8 cache: each layer's k/v scales from the checkpoint, else 1.0 (vLLM's default,
        with the same warning). A float cache uses none."""
        layers = self.model.attention_layers()
        with_scales = sum(1 for a in layers if a.checkpoint_kv_scales)
        for attn in layers:
            attn.k_scale = attn.checkpoint_kv_scales.get("k_scale", 1.0) if fp8 else 1.0
            attn.v_scale = attn.checkpoint_kv_scales.get("v_scale", 1.0) if fp8 else 1.0
        if fp8 and with_scales < len(layers):
            logger.warning(
                "FP8 KV cache: %d of %d layers have no k_scale/v_scale in the checkpoint; using 1.0 there "
                "(values beyond +-448 saturate). Checkpoints calibrated with a kv_cache_scheme carry them.",
                len(layers) - with_scales, len(layers),
            )
        elif not fp8 and (with_scales or (self.quant is not None and self.quant.kv_cache_fp8)):
            logger.info("the checkpoint is calibrated for an FP8 KV cache (kv_cache_scheme, k/v scales); "
                        "the cache stays %s unless --kv-cache-dtype fp8", str(self.dtype).removeprefix("torch."))

    def weights_summary(self) -> str:
        """"8.50 GiB (fp8 projections, the rest bfloat16)": roofline's byte count for this model
        and representation (the planner's formula), beside the bytes actually held."""
        from stoker.roofline.modelspec import spec_from_config

        rest = str(self.dtype).removeprefix("torch.")
        projections = self.quant.method if self.quant is not None else rest
        predicted = spec_from_config(self.hf_config).weight_bytes(projections, rest_dtype=rest)
        held = self.weight_bytes_held()
        return (f"{_size(predicted)} ({projections} projections, embeddings/norms/LM head {rest}; "
                f"{_size(held)} held, panel padding included)")

    def weight_bytes_held(self) -> int:
        """Bytes of every parameter the model holds (a tied weight counted once)."""
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    @property
    def bytes_per_block(self) -> int:
        return self.kv_spec.bytes_per_token * self.block_size

    def determine_num_blocks(self, max_num_batched_tokens: int) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            return memory.cuda_num_blocks(
                self.device,
                self.bytes_per_block,
                cache.gpu_memory_utilization,
                lambda: self._profile_forward(max_num_batched_tokens),
                cache.kv_cache_memory_bytes,
            )
        return memory.cpu_num_blocks(self.bytes_per_block, cache.kv_cache_memory_bytes)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.kv_spec.num_kv_heads, self.kv_spec.head_dim)
        self.kv_caches = []
        self.graph_runner = None  # captured graphs address the old cache
        for attn in self.model.attention_layers():
            k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.kv_caches.append((k, v))

    @torch.inference_mode()
    def _profile_forward(self, num_tokens: int) -> None:
        """A forward of `num_tokens` dummy prompt tokens with a scratch cache, for the memory peak."""
        from stoker.core.scheduler import ScheduledSequence
        from stoker.core.sequence import Sequence
        from stoker.sampling_params import SamplingParams

        num_tokens = min(num_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(num_blocks)
        seq = Sequence("profile", [0] * num_tokens, SamplingParams(max_tokens=1))
        out = SchedulerOutput([ScheduledSequence(seq, 0, num_tokens, list(range(num_blocks)))])
        self.execute(out, eos_token_ids=())
        self.kv_caches = []
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.release(seq.seq_id)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs (after allocate_kv_cache); a no-op on CPU or with enforce_eager."""
        if self.config.enforce_eager or self.device.type != "cuda":
            return
        ok, why_not = graphs_supported(self.device)
        if not ok:
            logger.warning("CUDA graphs off, decode runs eagerly: %s", why_not)
            return
        assert self.kv_caches, "allocate the KV cache before capturing: the graphs address it"
        graph_runner = CudaGraphRunner(
            self.model, self.config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size,
            self.hf_config["hidden_size"], self.dtype, self.device,
        )
        graph_runner.capture()
        self.graph_runner = graph_runner

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, eos_token_ids: tuple[int, ...]) -> StepResult:
        inputs = prepare_inputs(out, self.block_size, self.device)
        md = inputs.attn_metadata
        if self.graph_runner is not None and self.graph_runner.can_run(len(inputs.ordered), md):
            hidden = self.graph_runner.run(inputs.input_ids, inputs.positions, md)  # (B, hidden)
        else:
            set_attention_metadata(md)
            try:
                hidden = self.model(inputs.input_ids, inputs.positions)  # (T, hidden)
            finally:
                set_attention_metadata(None)
        if not inputs.sampled:
            return StepResult([], SamplerOutput([], [], []))
        # Logits only for the positions that sample: (S, hidden) -> (S, vocab).
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows = [
            SamplingRow(s.seq.sampling_params, s.seq.prompt_token_ids, s.seq.output_token_ids, self._generator(s.seq), eos_token_ids)
            for s in inputs.sampled
        ]
        return StepResult([s.seq.seq_id for s in inputs.sampled], self.sampler(logits, rows))

    def _generator(self, seq: Any) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            # n > 1: completion i draws from seed + i, so the completions differ but repeat.
            gen.manual_seed(seed + seq.index)
            self.generators[seq.seq_id] = gen
        return gen

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
