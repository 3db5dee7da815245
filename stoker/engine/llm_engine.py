"""The synchronous step loop and the registry of requests in flight.

Each step: the scheduler plans (pure Python), the executor runs the step message on its
runner(s), the scheduler learns what happened from the result (tokens accepted, blocks
hashed or freed), and the output processor turns the result into request outputs (text,
stops, logprobs). Requests come in already checked, as `EngineRequest`s made by the input
processor (engine/input_processor.py); the engine talks to its runners only through the
executor contract (stoker/executor/contract.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from stoker.config import EngineConfig
from stoker.core.expert_load import ExpertLoad
from stoker.core.block_manager import BlockManager
from stoker.core.proposer import make_proposer
from stoker.core.host_kv_pool import HostKVStats, make_host_kv_pool
from stoker.core.spec_decode_stats import SpecDecodingStats
from stoker.core.scheduler import Scheduler, SchedulerOutput
from stoker.core.sequence import Sequence, SequenceStatus
from stoker.core.step import StepMessage, StepResult, StepShape, build_step
from stoker.engine.input_processor import EngineRequest, InputLimits, InputProcessor
from stoker.engine.lora_manager import LoRAManager
from stoker.engine.output_processor import OutputProcessor, RequestState
from stoker.engine.spec_k import build_k_policy, cut_drafts
from stoker.engine.tokenizer import eos_token_ids, load_tokenizer
from stoker.executor.contract import WorkerFailedError
from stoker.executor.factory import make_executor
from stoker.kv_transfer.scheduler_side import check_kv_transfer, make_scheduler_connector
from stoker.models.loader import read_hf_config
from stoker.outputs import RequestOutput

logger = logging.getLogger(__name__)


class KVLoadError(RuntimeError):
    """A request's prompt K/V could not be read from the remote engine (policy "fail")."""


class StepFailed(RuntimeError):
    """A step raised for some requests: those were aborted (their KV blocks freed, nothing of
    theirs cached) and the engine is whole; `outputs` are the other requests' outputs of the
    step. Raised by `LLMEngine.step`; the server fails just those requests and goes on."""

    def __init__(self, cause: BaseException, request_ids: list[str], outputs: list[RequestOutput],
                 engine_fault: bool = True) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.request_ids = request_ids
        self.outputs = outputs
        # False: the requests' own failure (a KV read from a remote engine), never the engine's
        self.engine_fault = engine_fault


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
    spec_decoding: SpecDecodingStats | None = None  # speculative decoding's counters (None: off)
    kv_transfer: Any = None  # a KV connector's counters (stoker/kv_transfer/stats.py; None: none)
    host_kv: HostKVStats | None = None  # the host KV tier's counters (None: no --kv-offloading-size)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model_config.model
        self.hf_config = read_hf_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.max_model_len = resolve_max_model_len(self.hf_config, config.model_config.max_model_len)
        sched_cfg = config.scheduler_config
        self.max_num_batched_tokens = sched_cfg.token_budget(self.max_model_len)
        check_kv_transfer(config)
        self.executor = make_executor(config, self.hf_config, self.max_model_len)
        try:
            self.runner_info = self.executor.describe()  # rank 0's device, dtype, KV spec, weights
            num_blocks = self.executor.determine_num_blocks(self.max_num_batched_tokens)
            self._check_kv_capacity(num_blocks)
            cache_cfg = config.cache_config  # host KV tier (core/host_kv_pool.py); refused before any cache exists
            self.host_kv = make_host_kv_pool(cache_cfg.kv_offloading_size, config.parallel_config.tensor_parallel_size,
                                             cache_cfg.block_size, self.runner_info.bytes_per_block)
            self.executor.initialize_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker outlives a failed start
            raise
        block_size = config.cache_config.block_size
        self.block_manager = BlockManager(num_blocks, block_size, config.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, sched_cfg.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, sched_cfg.enable_chunked_prefill,
                                   config.lora_config.max_loras if config.lora_config is not None else None,
                                   sched_cfg.policy)
        # A KV connector's scheduler side (disaggregated prefill/decode: stoker/kv_transfer/), or None
        self.kv_connector = make_scheduler_connector(config, self.block_manager)
        self.scheduler.kv_connector = self.kv_connector
        # How a transfer poll that heard of nothing waits before the next: a plain sleep offline; the
        # serve loop (AsyncEngine) waits on its wake-up instead, so a request arriving meanwhile starts at once.
        self.transfer_poll_wait: Any = time.sleep
        if self.host_kv is not None:  # evicted blocks go to host memory; admission looks there past the device hit
            self.scheduler.host_kv = self.host_kv
            self.block_manager.on_evict = self.host_kv.offer
        # Multi-LoRA: the adapters known (host) and those in the compute slots
        self.lora = (LoRAManager(config.lora_config, self.hf_config, model_dir, self.executor,
                                 self.runner_info.lora_targets, self.runner_info.moe_layers)
                     if config.lora_config is not None else None)
        # Speculative decoding: drafts proposed before each step for the decoding sequences
        spec = config.speculative_config
        self.proposer = make_proposer(spec) if spec is not None and not spec.drafts_in_runner else None
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens) if spec is not None else None
        # draft_model / eagle3: the runner drafts after sampling; seq_id -> drafts for the next step
        self.runner_drafts: dict[int, list[int]] | None = {} if spec is not None and spec.drafts_in_runner else None
        self._grammars: Any = None  # GrammarCache, made on the first structured request
        self._grammars_lock = threading.Lock()
        self.input_limits = InputLimits(int(self.hf_config["vocab_size"]), self.max_model_len,
                                        self.max_num_batched_tokens, sched_cfg.enable_chunked_prefill,
                                        sched_cfg.policy == "priority",
                                        kv_transfer=config.kv_transfer_config is not None,
                                        tensor_parallel_size=config.parallel_config.tensor_parallel_size)
        self.input_processor = self.make_input_processor(self.tokenizer)
        self.spec_k_policy = build_k_policy(self)  # k chosen per step by the cost model (None: fixed k)
        self.runner_k: int | None = None  # the k this step chose for the runner's next proposals (None: configured)
        eos = eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len, self._finish_seq)
        self.requests: dict[str, RequestState] = {}
        self._seq_to_request: dict[int, RequestState] = {}
        self._prompt_tokens = 0
        self.last_step_shape: StepShape | None = None  # the shape of the last step run
        self.last_step_request_ids: list[str] = []  # the requests it computed for
        info, num_tokens = self.runner_info, num_blocks * block_size
        logger.info("weights %s", info.weights_summary)
        logger.info(
            "KV cache: %d blocks of %d tokens = %s tokens (%.1f MiB, %s on %s, %d bytes per token); %.2f requests of max_model_len %d fit",
            num_blocks, block_size, f"{num_tokens:,}", num_blocks * info.bytes_per_block / 2**20,
            info.kv_spec.dtype, info.device, info.kv_spec.bytes_per_token, num_tokens / self.max_model_len, self.max_model_len,
        )
        if self.host_kv is not None:
            hk = self.host_kv
            logger.info("host KV tier (--kv-offloading-size %g GiB, native): %d blocks of %d tokens = %s tokens "
                        "(%.1f MiB over %d rank(s)), %.1fx the device cache",
                        config.cache_config.kv_offloading_size, hk.num_blocks, block_size,
                        f"{hk.num_blocks * block_size:,}", hk.num_blocks * hk.bytes_per_block / 2**20,
                        config.parallel_config.tensor_parallel_size, hk.num_blocks / num_blocks)

    def _check_kv_capacity(self, num_blocks: int) -> None:
        """Refuse to start when one max_model_len sequence cannot fit the KV cache: such a
        request would be admitted and then never placed (vLLM refuses the same way)."""
        block_size = self.config.cache_config.block_size
        needed = -(-self.max_model_len // block_size)
        if num_blocks >= needed:
            return
        per_block = self.runner_info.bytes_per_block
        shorter = f", or lower --max-model-len to {num_blocks * block_size} or less" if num_blocks else ""
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks = {num_blocks * block_size} tokens "
            f"({num_blocks * per_block / 2**20:.1f} MiB at {per_block // block_size} bytes per token), but one "
            f"sequence of max_model_len {self.max_model_len} needs {needed} blocks ({needed * per_block / 2**20:.1f} MiB); "
            f"raise --kv-cache-memory-bytes to at least {needed * per_block} (or --gpu-memory-utilization on a GPU)"
            f"{shorter}"
        )

    # ------------------------------------------------------------------ inputs
    def make_input_processor(self, tokenizer: Any) -> InputProcessor:
        """A processor of requests for this engine that uses `tokenizer` (one per thread)."""
        return InputProcessor(tokenizer, self.input_limits, self.lora.has if self.lora is not None else None,
                              self.grammars)

    def grammars(self) -> Any:
        """The compiled-grammar cache (thread-safe), shared with the sampling runner (rank 0)."""
        with self._grammars_lock:  # the server compiles on its tokenizer thread
            if self._grammars is None:
                from stoker.structured.grammar import GrammarCache

                self._grammars = GrammarCache(self.tokenizer, self.hf_config["vocab_size"], self.eos_token_ids)
                self.executor.enable_structured_outputs(self._grammars)
        return self._grammars

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.output_processor.eos_token_ids

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        """Queue a checked request (InputProcessor.process made it): n sequences of its prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        params = request.params
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(request.request_id, request.prompt_token_ids, params, index=i,
                           arrival_time=request.arrival_time, lora_name=request.lora_name,
                           bad_words_token_ids=request.bad_words_token_ids, priority=request.priority,
                           cache_salt=request.cache_salt)
            seq.group_leader = seqs[0] if seqs else None
            seqs.append(seq)
        state = self.output_processor.start(request, seqs)
        for seq in seqs:
            self.scheduler.add(seq)
            self._seq_to_request[seq.seq_id] = state
        self.requests[request.request_id] = state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return self._finish_request(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

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
        self.collect_unloaded_loras()

    def collect_unloaded_loras(self) -> None:
        """Adapters being unloaded go once no sequence uses them (engine thread)."""
        if self.lora is not None:
            self.lora.collect_unloaded(s.lora_name for r in self.requests.values() for s in r.seqs
                                       if s.lora_name is not None and not s.is_finished)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        self.last_step_shape = None
        if self.proposer is not None or self.runner_drafts is not None:
            self._propose_drafts()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.kv_connector is not None and self.kv_connector.has_pending():
                return self._transfer_step(plan)
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not place any sequence: the KV cache is smaller than one "
                                   "request needs; raise kv_cache_memory_bytes or lower max_model_len")
            return []
        now = time.time()
        seq_to_request = self._seq_to_request
        for s in plan.scheduled:
            seq = s.seq
            num_output = len(seq.output_token_ids)  # seq.is_prefill, inlined (every sequence, every step)
            if num_output == 0 or len(seq.prompt_token_ids) + num_output - seq.num_computed_tokens > 1:
                self._prompt_tokens += s.num_tokens
                # A request is first scheduled with a prompt chunk (a decode's request has been before)
                metrics = seq_to_request[seq.seq_id].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
        lora_slots = None
        if self.lora is not None:
            names = {s.seq.lora_name for s in plan.scheduled if s.seq.lora_name is not None}
            lora_slots = self.lora.slots_for(names) if names else {}
        step = build_step(plan, self.eos_token_ids, lora_slots)
        if self.runner_drafts is not None and self.runner_k is not None:
            # the k just chosen caps the proposals the runner makes after this step (0: no draft
            # forward); a step without decodes chose none: its sequences propose up to the configured k
            step = dataclasses.replace(step, num_speculative_tokens=self.runner_k)
        if self.kv_connector is not None:
            step = dataclasses.replace(step, kv_connector_meta=self.kv_connector.build_connector_meta())
        self.last_step_shape = step.shape()  # the server prices it against the wall (roofline/live.py)
        self.last_step_request_ids = sorted({s.seq.request_id for s in plan.scheduled})
        try:
            result = self.executor.execute(step)
        except WorkerFailedError:
            raise  # not this batch's fault: the engine is dead (the caller fails every request)
        except Exception as exc:
            # The forward or the sampler raised: every request in this batch may be the cause.
            # Nothing of the step is kept (no token appended, no block hashed into the cache).
            failed = self.last_step_request_ids
            for request_id in failed:
                self.abort_request(request_id)
            logger.exception("a step failed; aborted its %d request(s): %s", len(failed), ", ".join(failed))
            raise StepFailed(exc, failed, []) from exc
        if self.spec_stats is not None:
            self._count_accepted(plan, result)
        if self.runner_drafts is not None:
            self.runner_drafts = result.draft_token_ids  # valid for the next step only
        self.scheduler.update_after_step(plan, result)
        failures: dict[str, BaseException] = {}
        touched = self.output_processor.process(result, self._seq_to_request, failures)
        make_output = self.output_processor.make_output
        # A final-only request (LLM.generate's) gets its output once, when it finishes
        outputs = [make_output(s) for s in touched
                   if (not failures or s.request_id not in failures) and (not s.request.final_only or s.finished)]
        if self.kv_connector is not None:  # the prefill leg's params; reads failed under policy "fail"
            for out in outputs:
                out.kv_transfer_params = self.kv_connector.take_kv_transfer_params(out.request_id)
            failures.update(self._kv_load_failures())
        for state in touched:
            if state.finished and (not failures or state.request_id not in failures):
                self._release_request(state)  # its output is in `outputs` already
        self.collect_unloaded_loras()
        if failures:
            for request_id in failures:
                self.abort_request(request_id)
            raise StepFailed(next(iter(failures.values())), sorted(failures), outputs,
                             engine_fault=not all(isinstance(e, KVLoadError) for e in failures.values()))
        return outputs

    # ------------------------------------------------------------------ KV connector
    def has_pending_kv_transfers(self) -> bool:
        """Reads in flight or blocks leased to remote readers: the loop steps to hear of them."""
        return self.kv_connector is not None and self.kv_connector.has_pending()

    def _transfer_step(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Nothing to compute but KV transfers to hear of: a step of no sequences starts the
        reads and polls for their end (and sleeps a little when nothing ended, not to spin).
        It carries the plan's host-tier copies: a request admitted to wait for its remote K/V
        loads its host hit (and the blocks it took from the free list are saved) in this step."""
        assert self.kv_connector is not None
        result = self.executor.execute(StepMessage([], kv_host_saves=tuple(plan.kv_host_saves),
                                                   kv_host_loads=tuple(plan.kv_host_loads),
                                                   kv_connector_meta=self.kv_connector.build_connector_meta()))
        self.scheduler.update_after_step(plan, result)
        failures = self._kv_load_failures()
        if failures:
            for request_id in failures:
                self.abort_request(request_id)
            raise StepFailed(next(iter(failures.values())), sorted(failures), [], engine_fault=False)
        if not (result.finished_recving or result.finished_sending):
            # a read in flight is polled every 2 ms; leases alone (a notification frees them) every 10 ms
            self.transfer_poll_wait(0.002 if self.kv_connector.waiting_for_remote else 0.01)
        return []

    def _kv_load_failures(self) -> dict[str, BaseException]:
        assert self.kv_connector is not None
        return {rid: KVLoadError(why) for rid, why in self.kv_connector.take_failed().items() if rid in self.requests}

    def _propose_drafts(self) -> None:
        """Drafts for every running sequence whose next step is a decode (only its last sampled
        token uncomputed). A sequence drafts at most what it may still emit: the step keeps its
        accepted drafts and one more token, within max_tokens and max_model_len."""
        wanted: dict[int, int] | None = {} if self.runner_drafts is not None else None
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0:
                continue
            room = self.max_model_len - seq.num_tokens - 1
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - seq.num_output_tokens - 1)
            if self.runner_drafts is not None:
                seq.draft_token_ids = self.runner_drafts.get(seq.seq_id, [])[: max(room, 0)]
                assert wanted is not None
                wanted[seq.seq_id] = max(room, 0)  # what it may propose after this step (about: one token later)
                continue
            assert self.proposer is not None
            seq.draft_token_ids = self.proposer.propose_for(seq, room) if room > 0 else []
        if self.spec_k_policy is not None:
            self.runner_k = cut_drafts(self, self.spec_k_policy, wanted)

    def _count_accepted(self, plan: SchedulerOutput, result: StepResult) -> None:
        """vllm:spec_decode_* counters: each verifying sequence's drafts and how many it kept."""
        assert self.spec_stats is not None
        for s in plan.scheduled:
            sampled = result.sampled.get(s.seq.seq_id)
            if s.num_draft_tokens and s.do_sample and sampled is not None:
                self.spec_stats.observe(s.num_draft_tokens, len(sampled.token_ids) - 1)
                if self.spec_k_policy is not None:
                    self.spec_k_policy.observe(s.num_draft_tokens, len(sampled.token_ids) - 1)

    def _finish_seq(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None) -> None:
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, status)
        self.executor.release(seq.seq_id)

    def _finish_request(self, state: RequestState) -> RequestOutput:
        output = self.output_processor.make_output(state)
        self._release_request(state)
        return output

    def _release_request(self, state: RequestState) -> None:
        """Forget a finished request: its sequences, their runner state, their drafts' tree."""
        state.metrics.finished_time = time.time()  # outputs share the metrics object: theirs too
        self.requests.pop(state.request_id, None)
        for seq in state.seqs:
            self._seq_to_request.pop(seq.seq_id, None)
            self.executor.release(seq.seq_id)
            if self.proposer is not None:
                self.proposer.on_finished(seq)  # suffix: its output joins the shared tree

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        # Requests, not sequences (an n > 1 request counts once), as vLLM's gauges count them;
        # a request with any sequence running is running.
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        if self.kv_connector is not None:  # waiting for their prompt's K/V count as waiting (as vLLM's)
            waiting |= {w.seq.request_id for w in self.kv_connector.waiting_for_remote.values() if not w.aborted}
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self.output_processor.num_generation_tokens,
            # (the server takes these after every step: no scan of the queues without LoRA)
            running_loras=tuple(sorted({s.lora_name for s in sched.running if s.lora_name})) if self.lora is not None else (),
            waiting_loras=tuple(sorted({s.lora_name for s in sched.waiting if s.lora_name})) if self.lora is not None else (),
            spec_decoding=self.spec_stats.snapshot() if self.spec_stats is not None else None,
            kv_transfer=self.kv_connector.stats.snapshot() if self.kv_connector is not None else None,
            host_kv=self.host_kv.stats() if self.host_kv is not None else None,
        )

    def expert_load(self) -> ExpertLoad | None:
        """Tokens routed per expert per MoE layer since start; None for a dense model. A device
        read: call it now and then (the server does at its log interval and on a scrape), not per step."""
        return self.executor.expert_load()

    def check_health(self) -> None:
        """Raise WorkerFailedError when a tensor-parallel rank is gone (the idle loop asks)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallelism); safe to call more than once."""
        self.executor.shutdown()

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        if self.host_kv is not None:
            self.host_kv.check_integrity()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes of all free blocks (vLLM's `reset_prefix_cache`), so the
        next requests compute their prompts from scratch; blocks in use keep theirs. Benchmarks
        call it between runs of the same prompts, which would otherwise hit the cache."""
        self.block_manager.reset_prefix_cache()
        if self.host_kv is not None:
            self.host_kv.reset()  # both tiers: the next prompts compute from scratch
        return True


def resolve_max_model_len(hf_config: dict[str, Any], asked: int | None) -> int:
    """max_model_len as asked, else the model's max_position_embeddings (a warning above it)."""
    limit = hf_config.get("max_position_embeddings")
    if asked is None:
        if limit is None:
            raise ValueError("config.json has no max_position_embeddings: pass max_model_len")
        return int(limit)
    if limit is not None and asked > limit:
        logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", asked, limit)
    return asked
