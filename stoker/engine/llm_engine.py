"""The synchronous step loop: add requests, `step()` until none are left.

Each step: the scheduler plans (pure Python), the runner executes one packed forward and
samples, then each sampled sequence gets its token, its text increment and its stop checks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from stoker.config import EngineConfig
from stoker.core.block_manager import BlockManager
from stoker.core.scheduler import Scheduler
from stoker.core.sequence import Sequence, SequenceStatus
from stoker.engine.detokenizer import DetokenizerState, decode_increment, find_stop_string, new_state
from stoker.engine.tokenizer import eos_token_ids, load_tokenizer
from stoker.models.loader import read_hf_config
from stoker.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from stoker.core.step import StepShape, build_step
from stoker.engine.executor import WorkerFailedError, make_executor
from stoker.engine.lora_manager import LoRAManager
from stoker.sampling.prompt_logprobs import PromptLogprobChunk
from stoker.sampling.sampler import SamplerOutput
from stoker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    detok: dict[int, DetokenizerState] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class StepFailed(RuntimeError):
    """A step raised for some requests: those were aborted (their KV blocks freed, nothing of
    theirs cached) and the engine is whole; `outputs` are the other requests' outputs of the
    step. Raised by `LLMEngine.step`; the server fails just those requests and goes on."""

    def __init__(self, cause: BaseException, request_ids: list[str], outputs: list[RequestOutput]) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.request_ids = request_ids
        self.outputs = outputs


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0-1
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int  # computed prompt tokens, cumulative
    generation_tokens: int  # sampled tokens, cumulative
    running_loras: tuple[str, ...] = ()  # LoRA adapters of running / waiting sequences (vllm:lora_requests_info)
    waiting_loras: tuple[str, ...] = ()


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model_config.model
        self.hf_config = read_hf_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_ids = eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        self.max_model_len = self._resolve_max_model_len()
        sched_cfg = config.scheduler_config
        self.max_num_batched_tokens = sched_cfg.token_budget(self.max_model_len)
        self.executor = make_executor(config, self.hf_config, self.max_model_len)
        try:
            self.runner = self.executor.runner  # this process's (rank 0's): for logs and introspection
            num_blocks = self.executor.determine_num_blocks(self.max_num_batched_tokens)
            self._check_kv_capacity(num_blocks)
            self.executor.initialize_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker outlives a failed start
            raise
        block_size = config.cache_config.block_size
        self.block_manager = BlockManager(num_blocks, block_size, config.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            sched_cfg.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            sched_cfg.enable_chunked_prefill,
            config.lora_config.max_loras if config.lora_config is not None else None,
        )
        # Multi-LoRA: the adapters known (host) and those in the compute slots
        self.lora = (LoRAManager(config.lora_config, self.hf_config, model_dir, self.executor)
                     if config.lora_config is not None else None)
        self.requests: dict[str, Request] = {}
        self._seq_to_request: dict[int, Request] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._grammars: Any = None  # GrammarCache, made on the first structured request
        self._grammars_lock = threading.Lock()
        self.last_step_shape: StepShape | None = None  # the shape of the last step run
        self.last_step_request_ids: list[str] = []  # the requests it computed for
        num_tokens = num_blocks * block_size
        kv = self.runner.kv_spec
        logger.info("weights %s", self.runner.weights_summary())
        logger.info(
            "KV cache: %d blocks of %d tokens = %s tokens (%.1f MiB, %s on %s, %d bytes per token); %.2f requests of max_model_len %d fit",
            num_blocks, block_size, f"{num_tokens:,}", num_blocks * self.runner.bytes_per_block / 2**20,
            kv.dtype, self.runner.device, kv.bytes_per_token, num_tokens / self.max_model_len, self.max_model_len,
        )

    def _check_kv_capacity(self, num_blocks: int) -> None:
        """Refuse to start when one max_model_len sequence cannot fit the KV cache: such a
        request would be admitted and then never placed (vLLM refuses the same way)."""
        block_size = self.config.cache_config.block_size
        needed = -(-self.max_model_len // block_size)
        if num_blocks >= needed:
            return
        per_block = self.runner.bytes_per_block
        shorter = f", or lower --max-model-len to {num_blocks * block_size} or less" if num_blocks else ""
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks = {num_blocks * block_size} tokens "
            f"({num_blocks * per_block / 2**20:.1f} MiB at {per_block // block_size} bytes per token), but one "
            f"sequence of max_model_len {self.max_model_len} needs {needed} blocks ({needed * per_block / 2**20:.1f} MiB); "
            f"raise --kv-cache-memory-bytes to at least {needed * per_block} (or --gpu-memory-utilization on a GPU)"
            f"{shorter}"
        )

    def _resolve_max_model_len(self) -> int:
        limit = self.hf_config.get("max_position_embeddings")
        asked = self.config.model_config.max_model_len
        if asked is None:
            if limit is None:
                raise ValueError("config.json has no max_position_embeddings: pass max_model_len")
            return int(limit)
        if limit is not None and asked > limit:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", asked, limit)
        return asked

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_name is not None and (self.lora is None or not self.lora.has(lora_name)):
            raise ValueError(f"no LoRA adapter named {lora_name!r} is loaded" if self.lora is not None else
                             "LoRA is off: build the engine with enable_lora=True (stoker serve --enable-lora)")
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt string or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        vocab = self.hf_config["vocab_size"]
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or [])):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {vocab}); got {[t for t in ids if t >= vocab][:5]}")
        if params.bad_words:
            params._bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # a cache hit when the server compiled it first
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(prompt_token_ids)} tokens; shorten the prompt"
            )
        arrival = arrival_time if arrival_time is not None else time.time()
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(request_id, prompt_token_ids, params, index=i, arrival_time=arrival, lora_name=lora_name)
            seq.group_leader = seqs[0] if seqs else None
            if seq.wants_prompt_logprobs:
                seq.prompt_logprobs = [None] * len(prompt_token_ids)  # the first token has none, ever
            seqs.append(seq)
        request = Request(request_id, prompt, prompt_token_ids, params, seqs, RequestMetrics(arrival_time=arrival))
        for seq in seqs:
            self.scheduler.add(seq)
            request.detok[seq.seq_id] = new_state(len(prompt_token_ids))
            self._seq_to_request[seq.seq_id] = request
        self.requests[request_id] = request

    @property
    def grammars(self) -> Any:
        """The compiled-grammar cache (thread-safe), shared with the sampling runner (rank 0)."""
        with self._grammars_lock:  # the server compiles in worker threads
            if self._grammars is None:
                from stoker.structured.grammar import GrammarCache, GrammarMatchers

                self._grammars = GrammarCache(self.tokenizer, self.hf_config["vocab_size"], self.eos_token_ids)
                self.runner.matchers = GrammarMatchers(self._grammars)
        return self._grammars

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the tokenizer writes it alone and after a space (vLLM's rule)."""
        out: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter (LoRAError naming what is wrong with it)."""
        if self.lora is None:
            raise ValueError("LoRA is off: build the engine with enable_lora=True (stoker serve --enable-lora)")
        self.lora.add(self.lora.read(name, path))

    def unload_lora(self, name: str) -> None:
        """New requests may no longer name it; requests in flight with it finish first."""
        if self.lora is None:
            raise ValueError("LoRA is off")
        self.lora.remove(name)
        self.lora.collect_unloaded(self._lora_in_use())

    def _lora_in_use(self) -> list[str]:
        return [s.lora_name for r in list(self.requests.values()) for s in r.seqs
                if s.lora_name is not None and not s.is_finished]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return self._finish_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        self.last_step_shape = None
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError(
                    "the scheduler could not place any sequence: the KV cache is smaller than one "
                    "request needs; raise kv_cache_memory_bytes or lower max_model_len"
                )
            return []
        now = time.time()
        for s in sched_out.scheduled:
            req = self._seq_to_request[s.seq.seq_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if s.seq.is_prefill:
                self._prompt_tokens += s.num_tokens
        lora_slots = None
        if self.lora is not None:
            names = {s.seq.lora_name for s in sched_out.scheduled if s.seq.lora_name is not None}
            lora_slots = self.lora.slots_for(names) if names else {}
        step = build_step(sched_out, self.eos_token_ids, lora_slots)
        self.last_step_shape = step.shape()  # the server prices it against the wall (roofline/live.py)
        self.last_step_request_ids = sorted({s.seq.request_id for s in sched_out.scheduled})
        try:
            result = self.executor.execute(step)
        except WorkerFailedError:
            raise  # not this batch's fault: the engine is dead (the caller fails every request)
        except Exception as exc:
            # The forward or the sampler raised: every request in this batch may be the cause.
            # Nothing of the step is kept (no token appended, no block hashed into the cache).
            failed = sorted({s.seq.request_id for s in sched_out.scheduled})
            for request_id in failed:
                self.abort_request(request_id)
            logger.exception("a step failed; aborted its %d request(s): %s", len(failed), ", ".join(failed))
            raise StepFailed(exc, failed, []) from exc
        self.scheduler.update_after_step(sched_out)
        self._record_prompt_logprobs(result.prompt_logprobs)
        failures: dict[str, BaseException] = {}
        touched = self._process_samples(result.seq_ids, result.sampler_output, failures)
        outputs = [self._make_output(req) for req in touched if req.request_id not in failures]
        for req in touched:
            if req.finished and req.request_id not in failures:
                self._finish_request(req)
        if self.lora is not None:  # adapters being unloaded go once no sequence uses them
            self.lora.collect_unloaded(self._lora_in_use())
        if failures:
            for request_id in failures:
                self.abort_request(request_id)
            cause = next(iter(failures.values()))
            raise StepFailed(cause, sorted(failures), outputs)
        return outputs

    def _record_prompt_logprobs(self, chunks: dict[int, PromptLogprobChunk]) -> None:
        """Each scored prompt token as vLLM's entry: {token: Logprob} with the top n beside it.
        A prompt recomputed after preemption scores the same positions again (same values)."""
        for seq_id, chunk in chunks.items():
            req = self._seq_to_request.get(seq_id)
            seq = next((s for s in req.seqs if s.seq_id == seq_id), None) if req is not None else None
            if seq is None or seq.prompt_logprobs is None:
                continue
            names = dict(zip(*self._decode_each({t for ids in chunk.top_ids for t in ids} | set(chunk.token_ids))))
            for j, token in enumerate(chunk.token_ids):
                entry = {tid: Logprob(val, r + 1, names[tid])
                         for r, (tid, val) in enumerate(zip(chunk.top_ids[j], chunk.top_logprobs[j]))}
                entry[token] = Logprob(chunk.logprobs[j], chunk.ranks[j], names[token])
                seq.prompt_logprobs[chunk.first_index + j] = entry

    def _decode_each(self, ids: set[int]) -> tuple[list[int], list[str]]:
        order = sorted(ids)
        return order, self.tokenizer.batch_decode([[t] for t in order])

    def _process_samples(self, seq_ids: list[int], out: SamplerOutput, failures: dict[str, BaseException]) -> list[Request]:
        """Append each row's token, text and stop checks; a request whose processing raises
        goes to `failures` (the others carry on)."""
        touched: dict[str, Request] = {}
        now = time.time()
        for row, seq_id in enumerate(seq_ids):
            req = self._seq_to_request[seq_id]
            if req.request_id in failures:
                continue
            try:
                self._process_row(req, seq_id, row, out, now)
            except Exception as exc:
                logger.exception("request %s failed while processing its sampled token", req.request_id)
                failures[req.request_id] = exc
            touched[req.request_id] = req
        return list(touched.values())

    def _process_row(self, req: Request, seq_id: int, row: int, out: SamplerOutput, now: float) -> None:
        seq = next(s for s in req.seqs if s.seq_id == seq_id)
        token = out.token_ids[row]
        seq.append_token(token)
        self._generation_tokens += 1
        seq.cumulative_logprob += out.logprobs[row]
        if seq.sampling_params.logprobs is not None:
            seq.output_logprobs.append(self._logprob_entry(token, out.logprobs[row], out.top_logprobs[row]))
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        self._append_text_and_check_stop(req, seq, token)

    def _logprob_entry(self, token: int, logprob: float, top: tuple[int, list[int], list[float]] | None) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entry: dict[int, Logprob] = {}
        if top is not None:
            rank, ids, vals = top
            for i, (tid, val) in enumerate(zip(ids, vals)):
                entry[tid] = Logprob(val, i + 1, decode([tid]))
            entry[token] = Logprob(logprob, rank, decode([token]))
        return entry

    def _append_text_and_check_stop(self, req: Request, seq: Sequence, token: int) -> None:
        p = seq.sampling_params
        past_min = seq.num_output_tokens >= p.min_tokens  # as vLLM: no stop of any kind before min_tokens
        is_eos = not p.ignore_eos and token in self.eos_token_ids and past_min
        is_stop_token = token in p.stop_token_ids and past_min
        # As vLLM: the token that ends the output (EOS or a stop token) adds no text unless
        # include_stop_str_in_output (with skip_special_tokens off, EOS would write "<|eot_id|>").
        if not ((is_stop_token or is_eos) and not p.include_stop_str_in_output):
            delta = decode_increment(self.tokenizer, seq.token_ids, req.detok[seq.seq_id], p.skip_special_tokens)
            seq.output_text += delta
        else:
            delta = ""
        if is_eos:
            return self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED, None)
        if is_stop_token:
            return self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED, token)
        if p.stop and delta and past_min:
            hit = find_stop_string(seq.output_text, len(delta), p.stop)
            if hit is not None:
                idx, stop = hit
                seq.output_text = seq.output_text[: idx + len(stop)] if p.include_stop_str_in_output else seq.output_text[:idx]
                return self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH, None)
        if seq.num_tokens >= self.max_model_len:
            return self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH, None)
        return None

    def _finish_seq(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None) -> None:
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, status)
        self.executor.release(seq.seq_id)

    def _finish_request(self, req: Request) -> RequestOutput:
        req.metrics.finished_time = time.time()
        output = self._make_output(req)
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            self._seq_to_request.pop(seq.seq_id, None)
            self.executor.release(seq.seq_id)
        return output

    def _make_output(self, req: Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None,
                finish_reason=seq.status.value if seq.is_finished else None,
                stop_reason=seq.stop_reason,
            )
            for seq in req.seqs
        ]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            metrics=req.metrics,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            # Shared, not copied per step: complete once the prompt is in, and never changed after.
            prompt_logprobs=req.seqs[0].prompt_logprobs,
        )

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        bm = self.block_manager
        # Requests, not sequences (an n > 1 request counts once), as vLLM's gauges count them;
        # a request with any sequence running is running.
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting} - running
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            running_loras=tuple(sorted({s.lora_name for s in self.scheduler.running if s.lora_name})),
            waiting_loras=tuple(sorted({s.lora_name for s in self.scheduler.waiting if s.lora_name})),
        )

    def check_health(self) -> None:
        """Raise WorkerFailedError when a tensor-parallel rank is gone (the idle loop asks)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallelism); safe to call more than once."""
        self.executor.shutdown()

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes of all free blocks (vLLM's `reset_prefix_cache`), so the
        next requests compute their prompts from scratch; blocks in use keep theirs. Benchmarks
        call it between runs of the same prompts, which would otherwise hit the cache."""
        self.block_manager.reset_prefix_cache()
        return True

    def model_info(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "vocab_size": self.hf_config["vocab_size"], "eos_token_ids": list(self.eos_token_ids)}
