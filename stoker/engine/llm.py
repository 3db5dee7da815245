"""The offline API, shaped like vLLM's `LLM` so existing scripts port."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence as Seq
from typing import Any

from stoker.lora.request import LoRARequest
from stoker.kv_transfer.config import KVTransferConfig
from stoker.kv_transfer.multi import merge_offloading_size
from stoker.kv_transfer.multi import resolve as resolve_kv_transfer_config
from stoker.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                           SpeculativeConfig)
from stoker.engine.llm_engine import LLMEngine
from stoker.outputs import RequestOutput
from stoker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        enforce_eager: bool = False,
        num_gpu_blocks_override: int | None = None,
        tensor_parallel_size: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        distributed_timeout_s: float = 600.0,
        enable_expert_parallel: bool = False,
        kv_cache_dtype: str = "auto",
        kv_offloading_size: float | None = None,
        kv_offloading_backend: str = "native",
        quantization: str | None = None,
        activation_dtype: str = "auto",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        kv_transfer_config: dict[str, Any] | str | KVTransferConfig | None = None,
    ) -> None:
        """speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 4, "prompt_lookup_min": 1} (docs/spec_decode.md)."""
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        elif speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(speculative_config).__name__}")
        if kv_transfer_config is not None and not isinstance(kv_transfer_config, KVTransferConfig):
            # vLLM's keys (docs/disaggregation.md); a MultiConnector or OffloadingConnector names the host tier too
            kv_transfer_config, offloading_gib = resolve_kv_transfer_config(kv_transfer_config)
            kv_offloading_size = merge_offloading_size(kv_offloading_size, offloading_gib)
        config = EngineConfig(
            model_config=ModelConfig(model=str(model), dtype=dtype, max_model_len=max_model_len, seed=seed, quantization=quantization,
                                     activation_dtype=activation_dtype),
            cache_config=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                num_gpu_blocks_override=num_gpu_blocks_override,
                kv_cache_dtype=kv_cache_dtype,
                kv_offloading_size=kv_offloading_size,
                kv_offloading_backend=kv_offloading_backend,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=scheduling_policy,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                nnodes=nnodes,
                node_rank=node_rank,
                master_addr=master_addr,
                master_port=master_port,
                distributed_timeout_s=distributed_timeout_s,
                enable_expert_parallel=enable_expert_parallel,
            ),
            device=device,
            enforce_eager=enforce_eager,
            lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank) if enable_lora else None,
            speculative_config=speculative_config,
            kv_transfer_config=kv_transfer_config,
        )
        self.engine = LLMEngine(config)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (they also stop when this process exits)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix not in use (as vLLM's `LLM.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """prompts: str | list[str] | {"prompt_token_ids": [...]} | a list of those.
        lora_request: one adapter for every prompt, or one (or None) per prompt, as vLLM's; an
        adapter not yet known is read from its lora_path."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = _one_per_prompt(SamplingParams() if sampling_params is None else sampling_params, SamplingParams,
                                      len(prompts), "sampling_params")
        loras = _one_per_prompt(lora_request, (LoRARequest, type(None)), len(prompts), "lora_requests")
        for lr in {lr for lr in loras if lr is not None}:
            if self.engine.lora is None or not self.engine.lora.has(lr.lora_name):
                self.engine.load_lora(lr.lora_name, lr.lora_path)
        ids: list[str] = []
        try:
            for prompt, params, lr in zip(prompts, params_list, loras):
                request_id = str(next(self._counter))
                text, token_ids = _split_prompt(prompt)
                request = self.engine.input_processor.process(request_id, text, params, token_ids,
                                                              lora_name=lr.lora_name if lr is not None else None)
                # _run reads only the finished outputs: no cumulative output built per step (vLLM's FINAL_ONLY)
                request = dataclasses.replace(request, final_only=True)
                self.engine.add_request(request)
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:  # nothing leaks if a prompt is rejected or the loop fails
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt, chat_template)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # A failed step (StepFailed) or Ctrl-C: leave no request of this call behind.
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
    raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")


def render_chat_text(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    documents: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as the model's chat template writes it (BOS included where it wants one).

    tools: OpenAI's `[{"type": "function", "function": {"name", "description", "parameters"}}]`,
    which HF chat templates read as `tools` (a template that does not use them ignores them).
    continue_final_message: the last message is left open (no end-of-turn after it), so the
    model continues it; documents: RAG documents, which templates that take them render;
    template_kwargs: more variables for the template (vLLM's chat_template_kwargs, e.g.
    `{"enable_thinking": False}`); names the template call sets itself are the caller's to refuse."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    if continue_final_message:
        extra["continue_final_message"] = True
    if documents:
        extra["documents"] = documents
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template, **extra
    )


def apply_chat_template(
    tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool = True, chat_template: str | None = None
) -> list[int]:
    text = render_chat_text(tokenizer, conversation, add_generation_prompt, chat_template)
    # The template writes BOS itself where the model wants one.
    return tokenizer.encode(text, add_special_tokens=False)


def _one_per_prompt(value: Any, single: type | tuple[type, ...], num_prompts: int, name: str) -> list[Any]:
    """One value for every prompt, or a sequence of one per prompt (as vLLM's generate takes them)."""
    if isinstance(value, single):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {name} for {num_prompts} prompts; give one, or one per prompt")
    return values
