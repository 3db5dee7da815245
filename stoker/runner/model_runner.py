"""Executes one step message: inputs -> forward over the packed batch -> logits -> tokens.

One runner per tensor-parallel rank, each holding its shard of the weights and of the KV
cache (its KV heads). Every rank runs the same forward on the same message; the LM head
gathers the logits on rank 0, which alone samples (`execute` returns None elsewhere).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from stoker import cpu_runtime
from stoker.config import EngineConfig
from stoker.core.expert_load import ExpertLoad
from stoker.core.step import SampledTokens, SampleSpec, SeqStep, StepMessage, StepResult
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.forward_context import ForwardContext, set_forward_context
from stoker.layers.moe import FusedMoE
from stoker.kernels._common import FP8_KV_DTYPE
from stoker.models.loader import build_model, load_weights
from stoker.quantization import config as quant_config
from stoker.quantization import gguf as gguf_quant
from stoker.runner.lora import ModelLoRASlots
from stoker.runner import memory
from stoker.runner.cuda_graph import CudaGraphRunner, graphs_supported
from stoker.runner.cpu_decode import CpuDecodeRunner
from stoker.runner.device import resolve_device, resolve_dtype
from stoker.runner.expert_load import ExpertLoadReader
from stoker.runner.host_kv_cache import HostKVCache, make_host_kv_cache
from stoker.runner.info import RunnerInfo
from stoker.runner.inputs import ModelInputs, prepare_inputs
from stoker.sampling.prompt_logprobs import score_prompt
from stoker.sampling.rejection import VerifyGroup, verify
from stoker.sampling.sampler import Sampler, SamplingRow
from stoker.sampling_params import SamplingParams
from stoker.spec_decode.drafter import Drafter
from stoker.spec_decode.factory import make_drafter

logger = logging.getLogger(__name__)

def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config: dict[str, Any], max_model_len: int, tp: TensorParallelGroup | None = None
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.tp = tp or TensorParallelGroup.single()
        self.device = resolve_device(config.device, self.tp.local_rank, self.tp.world_size)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device)
        self.block_size = config.cache_config.block_size
        self.max_model_len = max_model_len
        torch.manual_seed(config.model_config.seed)
        # Positions the engine serves: [0, max_model_len). The rotary cache holds exactly those,
        # and LongRoPE chooses its factor list by whether they pass the pretraining length.
        max_position = max_model_len
        # Quantization is decided once, before any parameter exists (an unsupported scheme is
        # refused here, before a tensor is read); each projection's method follows from it.
        if hf_config.get("gguf_architecture"):  # a GGUF file: a scheme per tensor type (quantization/gguf.py)
            self.quant = gguf_quant.resolve(hf_config, config.model_config.quantization)
        else:
            self.quant = quant_config.resolve(hf_config, config.model_config.quantization)
        activations = config.model_config.activation_dtype
        if activations != "auto":  # W4A8: the int4 projections' choice, made with their method
            if self.quant is None:
                raise ValueError(f"--activation-dtype {activations} is for int4 weights; this model's weights are float "
                                 "(load an int4 checkpoint or a Q4_0 / Q4_K GGUF file, or add --quantization int4)")
            self.quant = dataclasses.replace(self.quant, activation_dtype=activations)
        if self.device.type == "cpu":
            logger.info("%s", cpu_runtime.describe())
        lora = config.lora_config
        self.tp.expert_parallel = config.parallel_config.enable_expert_parallel  # read by the MoE blocks at build
        self.model = build_model(hf_config, max_position, self.dtype, self.device, self.quant, self.tp)
        int4_layers = (m for m in self.model.modules() if getattr(getattr(m, "method", None), "kind", None) == "int4")
        if activations != "auto" and next(int4_layers, None) is None:
            raise ValueError(f"--activation-dtype {activations} is for int4 weights; this model has no int4 projection "
                             f"(its weights are {self.quant.description}): use --activation-dtype auto")
        self.expert_load_reader = ExpertLoadReader(self.model)
        if config.parallel_config.enable_expert_parallel and not self.expert_load_reader.is_moe:
            # refused, not ignored: the flag would change nothing, and the user believes it did
            raise ValueError(f"expert parallelism (--enable-expert-parallel) is for Mixture-of-Experts models; "
                             f"{', '.join(hf_config.get('architectures') or ['this model'])} has no experts")
        if self.tp.expert_parallel and self.tp.world_size > 1:
            held = next(m.expert_split for m in self.model.modules() if isinstance(m, FusedMoE))
            logger.info("expert parallelism: rank %d holds experts [%d, %d) of %d in each MoE layer, whole",
                        self.tp.rank, held.start, held.stop, held.num_experts)
        load_weights(self.model, config.model_config.model)
        # Multi-LoRA: slots on every attention and MLP projection, filled by load_lora
        self.lora = ModelLoRASlots(self.model, lora.max_loras, lora.max_lora_rank, self.dtype, self.device) if lora else None
        self.sampler = Sampler(config.model_config.seed, self.device)
        self.generators: dict[int, torch.Generator] = {}
        self._rows: dict[int, SamplingRow] = {}  # seq_id -> its sampling row, kept between steps (sample)
        cache = config.cache_config
        self.kv_dtype = FP8_KV_DTYPE if cache.fp8_kv else self.dtype
        self.kv_spec = self.model.kv_cache_spec("fp8_e4m3" if cache.fp8_kv else str(self.dtype).removeprefix("torch."))
        self._apply_kv_scales(cache.fp8_kv)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Host KV tier (--kv-offloading-size): this rank's shard of the host blocks, host memory only
        self.host_kv: HostKVCache | None = make_host_kv_cache(config, self.kv_spec, len(self.model.attention_layers()),
                                                              self.kv_dtype, self.device, self.tp.world_size)
        self.graph_runner: CudaGraphRunner | None = None  # set by capture_cuda_graphs
        self.cpu_decode: CpuDecodeRunner | None = None  # set by capture_cuda_graphs on CPU (runner/cpu_decode.py)
        self.matchers: Any = None  # structured outputs' GrammarMatchers (enable_structured_outputs)
        spec = config.speculative_config  # draft_model / eagle3: a model drafts after each sampling
        self.drafter: Drafter | None = (make_drafter(config, self.model, hf_config, max_model_len, self.device, self.dtype,
                                                     self.tp)
                                        if spec is not None and spec.drafts_in_runner else None)
        self.kv_connector: Any = None  # a KV connector's worker side (start_kv_connector)

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
        and representation (the planner's formula), beside the bytes actually held (by this
        rank: a tensor-parallel rank holds its shard)."""
        from stoker.roofline.modelspec import spec_from_config

        rest = str(self.dtype).removeprefix("torch.")
        if self.quant is not None and self.quant.source == "gguf":  # a type per tensor: no one-dtype formula
            return f"{_size(self.weight_bytes_held())} held ({self.quant.description}; embeddings/norms {rest})"
        # mxfp4 quantizes only the experts: the spec prices them in their own dtype (expert_dtype)
        quantized = self.quant is not None and not self.quant.experts_only
        projections = self.quant.method if quantized else rest
        spec = spec_from_config(self.hf_config)
        if quantized and self.quant.weights.dtype == "int4":  # a scale (+ an offset if asymmetric) per group
            group = self.quant.weights.group_size if self.quant.weights.strategy == "group" else None
            scale_dtype, offsets = self._int4_scales_held()
            predicted = spec.engine_int4_weight_bytes(group, rest_dtype=rest, symmetric=not offsets, scale_dtype=scale_dtype)
            projections = ("int4 (bf16 scales and zeros, tinygemm layout)" if scale_dtype == "tinygemm"
                           else f"int4 ({scale_dtype} scales{', float32 offsets' if offsets else ''})")
        else:
            predicted = spec.weight_bytes(projections, rest_dtype=rest)
        held = self.weight_bytes_held()
        tp = self.tp.world_size
        by = f"{_size(held)} held by rank {self.tp.rank} of {tp}" if tp > 1 else f"{_size(held)} held"
        experts = f"{spec.expert_dtype} experts, " if spec.expert_dtype else ""
        return (f"{_size(predicted)} ({experts}{projections} projections, embeddings/norms/LM head {rest}; "
                f"{by}, panel padding included)")

    def _int4_scales_held(self) -> tuple[str, bool]:
        """("fp16" | "fp32" | "tinygemm", offsets held?) of the int4 projections: what
        process_after_loading chose from the loaded values (float16 scales where all of a layer's
        are exact; offsets only where not all zero; the tinygemm layout's scale and zero pairs). A model whose layers chose differently is priced by the widest."""
        layers = [m for m in self.model.modules() if getattr(getattr(m, "method", None), "kind", None) == "int4"]
        # int4 MoE experts (layers/moe_int4.py) hold w13/w2 scales and offsets in float32
        dense = [m for m in layers if hasattr(m, "weight_scale")]
        experts = [m for m in layers if not hasattr(m, "weight_scale")]
        if dense and not experts and all(getattr(m.method, "held", "") == "tinygemm" for m in dense):
            return "tinygemm", False  # a bfloat16 scale and zero per group, symmetric or not
        scales = [m.weight_scale for m in dense] + [m.w13_scale for m in experts]
        offsets = [m.weight_offset for m in dense] + [m.w13_offset for m in experts]
        wide = any(s.dtype == torch.float32 for s in scales)
        return ("fp32" if wide else "fp16"), any(o is not None for o in offsets)

    def describe(self) -> RunnerInfo:
        """This runner as plain values (the executor contract's `describe`)."""
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
        return RunnerInfo(str(self.device), device_name, str(self.dtype).removeprefix("torch."),
                          self.quant.method if self.quant is not None else None, self.kv_spec, self.bytes_per_block,
                          self.weights_summary(),
                          frozenset(self.lora.targets) if self.lora is not None else None,
                          self.lora.moe_layers if self.lora is not None else frozenset())

    def enable_structured_outputs(self, grammars: Any) -> None:
        """Mask the rows that carry a grammar with matchers over `grammars` (the engine's cache)."""
        from stoker.structured.grammar import GrammarMatchers

        if self.matchers is None:
            self.matchers = GrammarMatchers(grammars)

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
        draft = self.drafter.cache.bytes_per_block if self.drafter is not None else 0  # its cache shares the blocks
        return self.kv_spec.bytes_per_token * self.block_size + draft

    def determine_num_blocks(self, max_num_batched_tokens: int) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            num_blocks = memory.cuda_num_blocks(
                self.device,
                self.bytes_per_block,
                cache.gpu_memory_utilization,
                lambda: self._profile_forward(max_num_batched_tokens),
                cache.kv_cache_memory_bytes,
            )
        else:
            num_blocks = memory.cpu_num_blocks(self.bytes_per_block, cache.kv_cache_memory_bytes)
        # the draft's scratch blocks (spec_decode/draft_cache.py) come out of the same budget
        return num_blocks - (self.drafter.cache.reserved_blocks(self.bytes_per_block) if self.drafter is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.kv_spec.num_kv_heads, self.kv_spec.head_dim)
        self.kv_caches = []
        self.graph_runner = None  # captured graphs address the old cache
        self.cpu_decode = None  # and so do the fused CPU step's slots
        for attn in self.model.attention_layers():
            k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            # one cache per layer (multi-head latent attention's latent): no V
            v = torch.zeros(shape if self.kv_spec.kv_tensors == 2 else 0, dtype=self.kv_dtype, device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.kv_caches.append((k, v))
        if self.drafter is not None:
            self.drafter.cache.allocate(num_blocks)

    @torch.inference_mode()
    def _profile_forward(self, num_tokens: int) -> None:
        """A forward of `num_tokens` dummy prompt tokens with a scratch cache, for the memory peak."""
        num_tokens = min(num_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(num_blocks)
        seq = SeqStep(-1, [0] * num_tokens, 0, list(range(num_blocks)), do_sample=True)
        self.execute(StepMessage([seq], {-1: SampleSpec(SamplingParams(max_tokens=1), 0, 0)}))
        self.kv_caches = []
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        if self.drafter is not None:
            self.drafter.cache.free()
        self.release(-1)
        self.expert_load_reader.reset()  # the dummy tokens are no traffic

    def start_kv_connector(self) -> None:
        """Register the KV cache with the configured KV connector (after allocate_kv_cache)."""
        if self.config.kv_transfer_config is not None and self.kv_connector is None:
            from stoker.kv_transfer.worker_side import start_worker_connector

            self.kv_connector = start_worker_connector(self)

    def close_kv_connector(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None

    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy block src to block dst in every layer's K and V cache (StepMessage.kv_copies):
        one indexed copy per cache, (num_pairs, block_size, Hkv, D) each."""
        num_blocks = self.kv_caches[0][0].shape[0] if self.kv_caches else 0
        if any(not (0 <= b < num_blocks) for pair in pairs for b in pair):
            raise ValueError(f"kv_copies {list(pairs)} name blocks outside [0, {num_blocks})")
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            if v.numel():  # empty for a latent (MLA) cache
                v.index_copy_(0, dst, v.index_select(0, src))
        if self.drafter is not None:
            self.drafter.cache.copy_blocks(src, dst)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs (after allocate_kv_cache); on CPU, bind the decode step's one
        C call instead (runner/cpu_decode.py); a no-op with enforce_eager."""
        if self.config.enforce_eager:
            return
        if self.device.type == "cpu":
            self._bind_cpu_decode()
            return
        if self.device.type != "cuda":
            return
        if self.drafter is not None and not self.drafter.target_graphs_ok:
            logger.warning("CUDA graphs off with EAGLE-3 drafting (its hooks read the target's hidden states)")
            return
        if self.lora is not None:
            logger.warning("CUDA graphs off with LoRA (the per-step adapter mapping is not captured yet)")
            return
        moe = [m.method for m in self.model.modules() if isinstance(m, FusedMoE)]
        if any(not method.graph_capturable for method in moe):
            logger.warning("CUDA graphs off, decode runs eagerly: the Mixture-of-Experts method (%s) sizes its "
                           "per-expert GEMMs on the host", moe[0].describe())
            return
        eager = next((type(m).__name__ for m in self.model.modules() if getattr(m, "graph_capturable", True) is False), None)
        if eager is not None:  # a family's own experts (gpt-oss) that size their GEMMs on the host
            logger.warning("CUDA graphs off, decode runs eagerly: %s reads sizes on the host", eager)
            return
        if self.tp.world_size > 1:
            # Capturing NCCL collectives is possible (vLLM does) but not yet verified here.
            logger.warning("CUDA graphs off under tensor parallelism (not yet verified with NCCL in the graph)")
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
        self.expert_load_reader.reset()  # the capture's warm-up forwards are no traffic

    def _bind_cpu_decode(self) -> None:
        if self.lora is not None or (self.drafter is not None and not self.drafter.target_graphs_ok):
            why = "LoRA" if self.lora is not None else "the EAGLE-3 drafter reads the target's hidden states"
            logger.info("CPU decode runs module by module: %s", why)
            return
        assert self.kv_caches, "allocate the KV cache before binding the fused CPU decode: its slots address it"
        self.cpu_decode, why = CpuDecodeRunner.build(self.model, self.tp.world_size)
        if self.cpu_decode is None:
            logger.info("CPU decode runs module by module: %s", why)
        else:
            logger.info("CPU decode steps run as one C call (%d layers)", self.cpu_decode.layers.num_layers)

    def expert_load(self) -> ExpertLoad | None:
        """Tokens routed per expert per MoE layer since start (None for a dense model): a
        device-to-host copy, so the engine reads it at its log interval and on a scrape, not per step."""
        return self.expert_load_reader.read()

    # ------------------------------------------------------------------ step
    def execute(self, step: StepMessage) -> StepResult | None:
        """Run one step; the sampled tokens on rank 0, None on the other ranks."""
        if self.kv_connector is not None:  # reads start before the forward (stoker/kv_transfer/worker_side.py)
            return self.kv_connector.around_step(self, step)  # the config refuses a runner drafter beside it
        inputs, logits = self.forward(step)
        result = self.sample(step, inputs, logits)
        self.draft(step, inputs, result)
        return result

    def draft(self, step: StepMessage, inputs: ModelInputs, result: StepResult | None) -> None:
        """draft_model / eagle3: the next step's proposals into `result` (rank 0's; None on the
        other ranks, or on rank 0 when its sampling failed). Every rank calls it after each
        step's sampling, in lockstep: a sharded draft's forwards hold collectives. The grammars
        live on rank 0 (the other ranks' messages carry no sampling parameters): its argmax is
        masked, and its proposals are cut before the first token a grammar refuses."""
        if self.drafter is None:
            return
        mask = self._draft_mask(step) if result is not None else None
        drafts = self.drafter.propose(step, inputs, result.sampled if result is not None else None, mask)
        if result is not None:
            result.draft_token_ids = self._grammar_allowed(step, drafts)

    def _draft_mask(self, step: StepMessage) -> Any:
        """The grammars of the step's constrained sequences, for the draft's own argmax; None without any."""
        if self.matchers is None:
            return None
        grammars = {seq_id: spec.params.structured_outputs for seq_id, spec in step.sampling.items()
                    if spec.params.structured_outputs is not None}
        if not grammars:
            return None
        from stoker.structured.draft_mask import DraftMask

        return DraftMask(self.matchers, grammars)

    def _grammar_allowed(self, step: StepMessage, drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """A constrained sequence's proposals cut before the first its grammar refuses: verification
        would reject that one and drop the rest, so they are not worth a verify position."""
        if self.matchers is None:
            return drafts
        for seq_id, tokens in drafts.items():
            grammar = step.sampling[seq_id].params.structured_outputs
            if grammar is not None and tokens:
                del tokens[self.matchers.allowed_prefix(seq_id, grammar, tokens):]
        return drafts

    @torch.inference_mode()
    def copy_host_kv(self, step: StepMessage) -> None:
        """The step's host KV tier copies (saves, then loads), before anything writes a block: the
        forward's K/V, and a KV connector's reads (they start after these: a block a read fills may
        be one this step saves to host first)."""
        if step.kv_host_saves or step.kv_host_loads:
            if self.host_kv is None:
                raise ValueError("the step copies host KV blocks, but this runner has no host tier (--kv-offloading-size)")
            self.host_kv.run(self.kv_caches, step.kv_host_saves, step.kv_host_loads)
            if step.kv_host_saves and step.kv_connector_meta is not None and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # a NIXL read is not ordered on the stream

    @torch.inference_mode()
    def forward(self, step: StepMessage, *, host_kv_copied: bool = False) -> tuple[ModelInputs, torch.Tensor | None]:
        """The forward (every rank, in lockstep: it holds the collectives) -> (N, vocab) float32
        logits of the rows that sample (1 + len(drafts) per sampling sequence), on rank 0; None on
        the other ranks or when none samples. host_kv_copied: the caller ran copy_host_kv already."""
        if not host_kv_copied:
            self.copy_host_kv(step)
        if step.kv_copies:
            self.copy_blocks(step.kv_copies)
        inputs = prepare_inputs(step, self.block_size, self.device)
        md = inputs.attn_metadata
        if self.graph_runner is not None and self.graph_runner.can_run(len(inputs.ordered), md):
            hidden = self.graph_runner.run(inputs.input_ids, inputs.positions, md)  # (B, hidden)
        elif self.cpu_decode is not None and self.cpu_decode.can_run(len(inputs.ordered), md):
            hidden = self.cpu_decode.run(inputs.input_ids, inputs.positions, md)  # (B, hidden)
        else:
            mapping = self.lora.mapping(inputs.ordered, md.cu_seqlens_q) if self.lora is not None else None
            with set_forward_context(ForwardContext(md, mapping, kv_connector_meta=step.kv_connector_meta)):
                hidden = self.model(inputs.input_ids, inputs.positions)  # (T, hidden)
        self._score_prompts(inputs, hidden)
        if not inputs.sampled:
            return inputs, None
        return inputs, self.model.compute_logits(hidden[inputs.logits_indices])

    def _score_prompts(self, inputs: ModelInputs, hidden: torch.Tensor) -> None:
        """prompt_logprobs of the chunks that ask (every rank: the LM head's gather is collective)."""
        cu = inputs.attn_metadata.cu_seqlens_q
        for i, s in enumerate(inputs.ordered):
            if s.prompt_logprobs is None:
                continue
            num_top, targets = s.prompt_logprobs
            rows = hidden[cu[i] : cu[i] + len(targets)]  # (len(targets), hidden)
            chunk = score_prompt(rows, targets, num_top, s.start_pos + 1, self.model.compute_logits,
                                 self.hf_config["vocab_size"])
            if chunk is not None:
                inputs.prompt_logprobs[s.seq_id] = chunk

    @torch.inference_mode()
    def sample(self, step: StepMessage, inputs: ModelInputs, logits: torch.Tensor | None) -> StepResult | None:
        """Rank 0 only (no collective): one token per sampling row."""
        if not self.tp.is_first:
            return None
        if logits is None:
            return StepResult(prompt_logprobs=inputs.prompt_logprobs)
        if inputs.has_drafts:  # any(s.draft_token_ids for s in inputs.sampled), counted by prepare_inputs
            return StepResult(self._verify(step, inputs, logits), inputs.prompt_logprobs)
        rows = []
        constrained = []  # (row, seq_id, spec): rows a grammar masks
        sampling = step.sampling
        kept = self._rows
        eos = step.eos_token_ids
        for i, s in enumerate(inputs.sampled):
            seq_id = s.seq_id
            spec = sampling[seq_id]
            params = spec.params
            row = kept.get(seq_id)
            # A sequence keeps its row from step to step (its params, generator and bad words are
            # the request's); only what a step changes is set. Another params object: a new row.
            if (row is None or row.params is not params or row.eos_token_ids is not eos
                    or row.bad_words_token_ids is not spec.bad_words_token_ids):
                row = kept[seq_id] = self._new_row(seq_id, spec, eos)
            else:
                row.num_output_tokens = spec.num_output_tokens
                if spec.history_ids is not None:
                    row.prompt_ids, row.output_ids = spec.history_ids
            rows.append(row)
            if params.structured_outputs is not None:
                constrained.append((i, seq_id, params.structured_outputs))
        if constrained:
            self.matchers.mask(logits, constrained)
        out = self.sampler(logits, rows)
        for i, seq_id, _ in constrained:
            self.matchers.accept(seq_id, out.token_ids[i])
        sampled = {s.seq_id: SampledTokens([token], [logprob], [top])
                   for s, token, logprob, top in zip(inputs.sampled, out.token_ids, out.logprobs, out.top_logprobs)}
        return StepResult(sampled, inputs.prompt_logprobs)

    def _new_row(self, seq_id: int, spec: SampleSpec, eos_token_ids: tuple[int, ...]) -> SamplingRow:
        prompt_ids, output_ids = spec.history_ids or ([], [])
        return SamplingRow(spec.params, prompt_ids, output_ids, spec.num_output_tokens,
                           self._generator(seq_id, spec), eos_token_ids, spec.bad_words_token_ids)

    def _verify(self, step: StepMessage, inputs: ModelInputs, logits: torch.Tensor) -> dict[int, SampledTokens]:
        """Speculative decoding: (N, V) logits, 1 + len(drafts) rows per sampling sequence ->
        each sequence's accepted drafts and the token after them (sampling/rejection.py). Row j
        of a sequence sees its output with drafts 0..j-1 appended (penalties, min_tokens, bad words)."""
        rows: list[SamplingRow] = []
        groups: list[VerifyGroup] = []
        constrained = []  # (first row, seq_id, grammar spec, drafts): groups a grammar masks row by row
        for s in inputs.sampled:
            spec = step.sampling[s.seq_id]
            if spec.params.structured_outputs is not None:
                constrained.append((len(rows), s.seq_id, spec.params.structured_outputs, s.draft_token_ids))
            prompt_ids, output_ids = spec.history_ids or ([], [])
            generator = self._generator(s.seq_id, spec)
            drafts = list(s.draft_token_ids)
            for j in range(len(drafts) + 1):
                history = output_ids + drafts[:j] if spec.history_ids is not None else []
                rows.append(SamplingRow(spec.params, prompt_ids, history, spec.num_output_tokens + j,
                                        generator, step.eos_token_ids, spec.bad_words_token_ids))
            groups.append(VerifyGroup(s.seq_id, s.draft_token_ids))
        if constrained:
            self.matchers.mask_drafts(logits, constrained)
        kept = verify(self.sampler, logits, rows, groups)
        for _, seq_id, grammar, _ in constrained:
            self.matchers.accept_tokens(seq_id, grammar, kept[seq_id].token_ids)
        return kept

    def _generator(self, seq_id: int, spec: SampleSpec) -> torch.Generator | None:
        seed = spec.params.seed
        if seed is None:
            return None
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            # n > 1: completion i draws from seed + i, so the completions differ but repeat.
            gen.manual_seed(seed + spec.index)
            self.generators[seq_id] = gen
        return gen

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Copy a host adapter into its compute slot (the engine's LoRA manager picks the slot)."""
        assert self.lora is not None, "LoRA is off: build the engine with a LoRAConfig"
        self.lora.load(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        assert self.lora is not None
        self.lora.clear(slot)

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
        self._rows.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.release(seq_id)
        if self.matchers is not None:
            self.matchers.release(seq_id)
