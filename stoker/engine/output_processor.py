"""From a step's result to request outputs: text, stops, logprobs (DESIGN.md, seam 22).

The scheduler has already appended each sequence's accepted tokens (`update_after_step`). For
every sequence that sampled, the output processor walks its new tokens in order: the token's
logprob entry, its text increment (incremental detokenization), then the stop checks in vLLM's
order (EOS, a stop token, a stop string, max_tokens, the context limit), none before
`min_tokens`. A stop ends the sequence at that token: later tokens accepted in the same step
(several, with draft tokens) are dropped from its output. Prompt logprobs are recorded as the
prefill chunks compute them. `RequestOutput`s are cumulative (text and ids so far).

Finishing a sequence (freeing its blocks, its sampling state) is the engine's: the processor
calls the `finish_seq` it was given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stoker.core.sequence import FINISHED_STATUSES, Sequence, SequenceStatus
from stoker.core.step import PromptLogprobChunk, SampledTokens, StepResult
from stoker.engine.detokenizer import DetokenizerState, decode_increment, fast_decode, find_stop_string, new_state
from stoker.engine.input_processor import EngineRequest
from stoker.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)

FinishSeq = Callable[[Sequence, SequenceStatus, "int | str | None"], None]


@dataclass
class RequestState:
    """One request in the engine: its sequences (n) and what its outputs are built from."""

    request: EngineRequest
    seqs: list[Sequence]
    metrics: RequestMetrics
    detok: dict[int, DetokenizerState] = field(default_factory=dict)  # seq_id -> its detokenizer window

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status not in FINISHED_STATUSES:  # s.is_finished, inlined
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_model_len: int, finish_seq: FinishSeq) -> None:
        self.tokenizer = tokenizer
        self._decode = fast_decode(tokenizer)  # tokenizer.decode's text, made cheaper per call
        # skip_special_tokens -> {token: its text alone}: at most the vocabulary, per value
        self._one_token: dict[bool, dict[int, str]] = {True: {}, False: {}}
        self._token_texts: dict[int, str] = {}  # token -> tokenizer.decode([token]): logprobs' names
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.finish_seq = finish_seq
        self.num_generation_tokens = 0  # tokens kept in outputs, cumulative

    def start(self, request: EngineRequest, seqs: list[Sequence]) -> RequestState:
        state = RequestState(request, seqs, RequestMetrics(arrival_time=request.arrival_time))
        for seq in seqs:
            state.detok[seq.seq_id] = new_state(seq.num_prompt_tokens)
            if seq.wants_prompt_logprobs:
                seq.prompt_logprobs = [None] * seq.num_prompt_tokens  # the first token has none, ever
        return state

    # ------------------------------------------------------------------ one step
    def process(
        self, result: StepResult, states: dict[int, RequestState], failures: dict[str, BaseException]
    ) -> list[RequestState]:
        """Record the step's prompt logprobs and each sampled sequence's new tokens; returns the
        requests it touched, in row order. A request whose processing raises goes to `failures`
        (the others carry on). states: seq_id -> its request."""
        self._record_prompt_logprobs(result.prompt_logprobs, states)
        touched: dict[str, RequestState] = {}
        now = time.time()
        for seq_id, sampled in result.sampled.items():
            state = states.get(seq_id)
            if state is None:
                continue
            request_id = state.request.request_id
            if failures and request_id in failures:
                continue
            try:
                self._process_seq(state, seq_id, sampled, now)
            except Exception as exc:
                logger.exception("request %s failed while processing its sampled token", request_id)
                failures[request_id] = exc
            touched[request_id] = state
        return list(touched.values())

    def _process_seq(self, state: RequestState, seq_id: int, sampled: SampledTokens, now: float) -> None:
        seqs = state.seqs
        seq = seqs[0] if seqs[0].seq_id == seq_id else next(s for s in seqs if s.seq_id == seq_id)
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        token_ids = sampled.token_ids
        logprobs = sampled.logprobs
        first = len(seq.output_token_ids) - len(token_ids)  # index of the first new token in the output
        wants_logprobs = seq.sampling_params.logprobs is not None
        if len(token_ids) == 1 and not wants_logprobs:  # one token, no logprobs: the loop below, unrolled
            self.num_generation_tokens += 1
            seq.cumulative_logprob += logprobs[0]
            stopped = self._append_text_and_check_stop(state, seq, token_ids[0], first + 1)
            if stopped is not None:
                self.finish_seq(seq, *stopped)  # nothing was accepted after it
            return
        append_text_and_check_stop = self._append_text_and_check_stop
        for j, token in enumerate(token_ids):
            self.num_generation_tokens += 1
            seq.cumulative_logprob += logprobs[j]
            if wants_logprobs:
                seq.output_logprobs.append(self._logprob_entry(token, logprobs[j], sampled.top_logprobs[j]))
            stopped = append_text_and_check_stop(state, seq, token, first + j + 1)
            if stopped is not None:
                del seq.output_token_ids[first + j + 1 :]  # accepted after the stop: not the client's
                self.finish_seq(seq, *stopped)
                return

    def _logprob_entry(self, token: int, logprob: float, top: tuple[int, list[int], list[float]] | None) -> dict[int, Logprob]:
        text = self._token_text
        entry: dict[int, Logprob] = {}
        if top is not None:
            rank, ids, vals = top
            for i, (tid, val) in enumerate(zip(ids, vals)):
                entry[tid] = Logprob(val, i + 1, text(tid))
            entry[token] = Logprob(logprob, rank, text(token))
        return entry

    def _token_text(self, token: int) -> str:
        """tokenizer.decode([token]) (its default arguments), cached: logprobs name k + 1 tokens
        per generated token, from a vocabulary's worth at most."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _append_text_and_check_stop(
        self, state: RequestState, seq: Sequence, token: int, num_output: int
    ) -> tuple[SequenceStatus, int | str | None] | None:
        """The text `token` adds (the output's `num_output`-th) and whether it ends the sequence:
        (status, stop reason) or None."""
        p = seq.sampling_params
        past_min = num_output >= p.min_tokens  # as vLLM: no stop of any kind before min_tokens
        is_eos = past_min and not p.ignore_eos and token in self.eos_token_ids
        is_stop_token = past_min and bool(p.stop_token_ids) and token in p.stop_token_ids
        # As vLLM: the token that ends the output (EOS or a stop token) adds no text unless
        # include_stop_str_in_output (with skip_special_tokens off, EOS would write "<|eot_id|>").
        delta = ""
        num_prompt = len(seq.prompt_token_ids)
        if not ((is_stop_token or is_eos) and not p.include_stop_str_in_output):
            detok = state.detok[seq.seq_id]
            start = detok.prefix_offset
            skip = p.skip_special_tokens
            one_token = self._one_token.get(skip)
            if start >= num_prompt:  # the window is all output (every token once past the prompt's end)
                window = seq.output_token_ids[start - num_prompt : num_output]
            else:
                window = seq.tokens_slice(start, num_prompt + num_output)
            if detok.read_offset - start == 1 and one_token is not None:
                # decode_increment's common case (a one-token prefix, its text cached), inlined:
                # the same decodes and the same state changes, without the call per token
                decode = self._decode
                prefix_text = one_token.get(window[0])
                if prefix_text is None:
                    prefix_text = one_token[window[0]] = decode(window[:1], skip_special_tokens=skip)
                full_text = decode(window, skip_special_tokens=skip)
                if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                    delta = full_text[len(prefix_text) :]
                    detok.prefix_offset = read_offset = detok.read_offset
                    detok.read_offset = read_offset + len(window) - 1
            else:
                delta = decode_increment(self.tokenizer, window, detok, skip, self._decode, one_token)
            if delta:
                seq.output_text += delta
        if is_eos:
            return SequenceStatus.FINISHED_STOPPED, None
        if is_stop_token:
            return SequenceStatus.FINISHED_STOPPED, token
        if p.stop and delta and past_min:
            hit = find_stop_string(seq.output_text, len(delta), p.stop)
            if hit is not None:
                idx, stop = hit
                seq.output_text = seq.output_text[: idx + len(stop)] if p.include_stop_str_in_output else seq.output_text[:idx]
                return SequenceStatus.FINISHED_STOPPED, stop
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        if num_prompt + num_output >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None

    def _record_prompt_logprobs(self, chunks: dict[int, PromptLogprobChunk], states: dict[int, RequestState]) -> None:
        """Each scored prompt token as vLLM's entry: {token: Logprob} with the top n beside it.
        A prompt recomputed after preemption scores the same positions again (same values)."""
        for seq_id, chunk in chunks.items():
            state = states.get(seq_id)
            seq = next((s for s in state.seqs if s.seq_id == seq_id), None) if state is not None else None
            if seq is None or seq.prompt_logprobs is None:
                continue
            order = sorted({t for ids in chunk.top_ids for t in ids} | set(chunk.token_ids))
            names = dict(zip(order, self.tokenizer.batch_decode([[t] for t in order])))
            for j, token in enumerate(chunk.token_ids):
                entry = {tid: Logprob(val, r + 1, names[tid])
                         for r, (tid, val) in enumerate(zip(chunk.top_ids[j], chunk.top_logprobs[j]))}
                entry[token] = Logprob(chunk.logprobs[j], chunk.ranks[j], names[token])
                seq.prompt_logprobs[chunk.first_index + j] = entry

    # ------------------------------------------------------------------ outputs
    @staticmethod
    def make_output(state: RequestState) -> RequestOutput:
        # Positional arguments (in the dataclasses' field order): a keyword call costs about
        # twice as much, and this runs once per request per step while the server streams.
        completions = []
        finished = True
        for seq in state.seqs:
            status = seq.status
            done = status in FINISHED_STATUSES
            if not done:
                finished = False
            completions.append(CompletionOutput(
                seq.index,
                seq.output_text,
                list(seq.output_token_ids),
                seq.cumulative_logprob,
                list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None,
                status.value if done else None,  # finish_reason
                seq.stop_reason,
            ))
        req = state.request
        first = state.seqs[0]
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            completions,
            finished,
            state.metrics,
            first.num_cached_tokens,
            # prompt_logprobs: shared, not copied per step: complete once the prompt is in, and never changed after.
            first.prompt_logprobs,
        )
