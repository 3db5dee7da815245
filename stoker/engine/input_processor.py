"""One request object, built and checked once: `InputProcessor.process` -> `EngineRequest`.

Everything the engine needs to know about a request is settled here, before it reaches the
engine thread (vLLM V1's `InputProcessor`): the prompt tokenized, token ids in the vocabulary,
the prompt within `max_model_len` (and within one step's budget with chunked prefill off), the
LoRA adapter known, the structured-output grammar compiled (the step loop then finds it in the
cache), `bad_words` tokenized. The engine and the scheduler trust an `EngineRequest`; the
server runs `process` on its tokenizer thread (off the event loop) and answers an `InputError`
with a 400 naming `param`.

Thread safety: `process` uses only the tokenizer it was given (a fast tokenizer is not shared
between threads: the engine and the server each build a processor with their own), the LoRA
registry (locked) and the grammar cache (locked).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker.sampling_params import SamplingParams


class InputError(ValueError):
    """A request the engine cannot run as given; `param` names the request field to change."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class EngineRequest:
    """A checked request, as it crosses into the engine (never a tuple of its fields)."""

    request_id: str
    prompt: str | None  # the text, when the request gave one (outputs echo it)
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lora_name: str | None = None
    # bad_words as token ids: each word alone and after a space (vLLM's rule)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    priority: int = 0  # lower runs first under --scheduling-policy priority
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    # vLLM's RequestOutputKind.FINAL_ONLY (what its LLM.generate asks): `LLMEngine.step` returns
    # this request's output only once it is finished, not the cumulative one of every step
    final_only: bool = False


@dataclass(frozen=True)
class InputLimits:
    """The engine's limits a request is checked against (fixed once the engine is built)."""

    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    priority_scheduling: bool = False  # --scheduling-policy priority: requests may ask for a priority
    kv_transfer: bool = False  # --kv-transfer-config: requests may carry kv_transfer_params
    tensor_parallel_size: int = 1  # a decode leg's remote engine must have the same (kv_transfer_params tp_size)


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        limits: InputLimits,
        has_lora: Callable[[str], bool] | None,
        grammars: Callable[[], Any],
    ) -> None:
        """has_lora: whether an adapter of that name may be asked for (None: LoRA is off);
        grammars: the engine's compiled-grammar cache, made on first use."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.has_lora = has_lora
        self.grammars = grammars

    def process(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> EngineRequest:
        arrival = time.time() if arrival_time is None else arrival_time
        params = params or SamplingParams()
        if priority != 0 and not self.limits.priority_scheduling:
            raise InputError(f"priority {priority}: this server schedules first come, first served; start it with "
                             "--scheduling-policy priority, or send priority 0", "priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InputError("cache_salt must be a non-empty string", "cache_salt")
        if params.kv_transfer_params is not None:
            self._check_kv_transfer(params)
        if lora_name is not None:
            if self.has_lora is None:
                raise InputError("LoRA is off: build the engine with enable_lora=True (stoker serve --enable-lora)",
                                 "model")
            if not self.has_lora(lora_name):
                raise InputError(f"no LoRA adapter named {lora_name!r} is loaded", "model")
        if prompt_token_ids is None:
            if prompt is None:
                raise InputError("give a prompt string or prompt_token_ids", "prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        self._check_ids(ids, params)
        self._check_length(len(ids))
        bad_words = self._bad_words_token_ids(params.bad_words) if params.bad_words else ()
        if params.structured_outputs is not None:
            spec = params.structured_outputs
            try:
                self.grammars().compile(spec)
            except ValueError as exc:
                raise InputError(str(exc), "response_format" if spec.kind in ("json", "json_object")
                                 else "structured_outputs") from None
        return EngineRequest(request_id, prompt, ids, params, arrival, lora_name, bad_words, priority, cache_salt)

    # ------------------------------------------------------------------ checks
    def _check_kv_transfer(self, params: SamplingParams) -> None:
        """kv_transfer_params only with a KV connector, with vLLM's keys, one completion."""
        from stoker.kv_transfer.params import check

        if not self.limits.kv_transfer:
            raise InputError("kv_transfer_params: this server runs no KV connector; start it with --kv-transfer-config "
                             "(docs/disaggregation.md), or omit kv_transfer_params", "kv_transfer_params")
        try:
            check(params.kv_transfer_params)
        except ValueError as exc:
            raise InputError(str(exc), "kv_transfer_params") from None
        p = params.kv_transfer_params
        tp = p.get("tp_size", 1) if p.get("do_remote_prefill") else self.limits.tensor_parallel_size
        if tp != self.limits.tensor_parallel_size:
            # each rank reads the same rank's heads of the prefill engine: other splits would need re-slicing
            raise InputError(f"kv_transfer_params tp_size {tp}: the prefill engine's tensor-parallel size differs "
                             f"from this engine's ({self.limits.tensor_parallel_size}); serve both engines with the "
                             "same --tensor-parallel-size (heterogeneous TP is not supported)", "kv_transfer_params")
        if params.n != 1:
            raise InputError("kv_transfer_params: disaggregated prefill/decode serves one completion per request; "
                             "send n 1", "n")

    def _check_ids(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.limits.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt: token ids must be in [0, {vocab}); got {bad[:5]}", "prompt")
        for name, asked in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or [])):
            out_of_range = [t for t in asked if t >= vocab]
            if out_of_range:
                raise InputError(f"{name}: token ids must be in [0, {vocab}); got {out_of_range[:5]}", name)

    def _check_length(self, num_tokens: int) -> None:
        lim = self.limits
        if num_tokens == 0:
            raise InputError("the prompt is empty; give at least one token", "prompt")
        if num_tokens > lim.max_model_len:
            raise InputError(
                f"This model's maximum context length is {lim.max_model_len} tokens. However, your prompt has "
                f"{num_tokens} tokens. Please reduce the length of the prompt.", "prompt")
        if not lim.enable_chunked_prefill and num_tokens > lim.max_num_batched_tokens:
            raise InputError(
                f"the prompt has {num_tokens} tokens, more than max_num_batched_tokens ({lim.max_num_batched_tokens}) "
                "with chunked prefill off; shorten the prompt, raise --max-num-batched-tokens or turn chunked prefill on",
                "prompt")

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the tokenizer writes it alone and after a space (vLLM's rule)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)
