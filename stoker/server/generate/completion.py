"""POST /v1/completions: prompts (text, token ids, or lists of either) -> choices, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stoker.outputs import CompletionOutput, RequestOutput
from stoker.sampling_params import SamplingParams
from stoker.server.errors import bad_request
from stoker.server.generate.protocol import CompletionRequest
from stoker.server.generate.serving import (DONE, SYSTEM_FINGERPRINT, ChunkEncoder, DeltaTracker, Serving, now_s,
                                            response_id, running_usage, sse)

# -inf is not JSON; clients read a very negative number the same way.
_MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


class OpenAIServingCompletion(Serving):
    async def prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt, cut to truncate_prompt_tokens (a cut text prompt
        keeps no text: its echo is the kept tokens' decoding)."""
        prompt = req.prompt
        tok = self.state.tokenization
        special, bounded = req.add_special_tokens, req.truncate_prompt_tokens is None
        if isinstance(prompt, str):
            out: list[tuple[str | None, list[int]]] = [(prompt, await tok.encode(prompt, special, bounded=bounded))]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        elif all(isinstance(p, str) for p in prompt):
            out = list(zip(prompt, await tok.encode_all(prompt, special, bounded)))
        # Token ids are checked against the vocabulary by the engine's input processor (add_all).
        elif all(isinstance(p, int) for p in prompt):
            out = [(None, list(prompt))]
        else:
            out = [(None, list(ids)) for ids in prompt]
        if bounded:
            return out
        try:
            cut = [(text, req.truncated(ids, self.state.max_model_len)) for text, ids in out]
        except ValueError as exc:
            raise bad_request(str(exc), "truncate_prompt_tokens") from None
        return [(text if len(kept) == len(ids) else None, kept) for (text, ids), (_, kept) in zip(out, cut)]

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.state.check_model(req.model)
        self.state.ready_engine()
        self.check_logprobs(req.logprobs, "logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        # max_tokens 0 with echo (lm-eval's scoring request): the prompt alone comes back. The
        # engine still samples one token (every sequence does), which is dropped, as vLLM does.
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens 0 returns nothing without echo; ask for at least 1 token, or set echo "
                              "to score the prompt alone", "max_tokens")
        # echo + logprobs: the echoed prompt tokens carry their own logprobs (the first none).
        num_prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else req.prompt_logprobs
        prompts = await self.prompts(req)
        params = [
            replace(self.sampling_params(req, self.resolve_max_tokens(len(ids), 1 if echo_only else req.max_tokens),
                                         req.logprobs), prompt_logprobs=num_prompt_logprobs)
            for _, ids in prompts
        ]
        echo_texts = [self._prompt_text(t, ids) for t, ids in prompts] if req.echo else None
        request_id, engine_id = response_id("cmpl", req.request_id)
        streams = await self.add_all(engine_id, prompts, params, lora_name=self.state.lora_name(req.model), req=req)
        created = now_s()
        prompt_lens = [len(ids) for _, ids in prompts]
        if req.stream:
            body = self._stream(request_id, model, created, streams, params, prompts, echo_texts, req)
            return StreamingResponse(body, media_type="text/event-stream")
        outputs = await self.until_disconnect(raw, self.collect(streams))
        if echo_only:
            outputs = [_without_generation(o) for o in outputs]
        choices = []
        for i, out in enumerate(outputs):
            for comp in out.outputs:
                echo = echo_texts[i] if echo_texts else ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._logprobs(comp, 0, len(comp.token_ids), len(echo), req)
                    if echo_texts:
                        logprobs = self._with_echo(prompts[i][1], out.prompt_logprobs, logprobs, req)
                choice = {
                    "index": i * req.n + comp.index,
                    "text": echo + comp.text,
                    "logprobs": logprobs,
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        return JSONResponse({
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": self.usage(prompt_lens, outputs),
            **self._timings(outputs),
            **({"kv_transfer_params": outputs[0].kv_transfer_params} if outputs[0].kv_transfer_params else {}),
        })

    def _timings(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """`stoker_timing`: one entry per prompt (--enable-request-timing), else nothing."""
        timings = [self.timing(o) for o in outputs]
        return {"stoker_timing": timings} if any(t is not None for t in timings) else {}

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.state.tokenizer.decode(ids)

    async def _stream(
        self, request_id: str, model: str, created: int, streams: list, params: list[SamplingParams],
        prompts: list[tuple[str | None, list[int]]], echo_texts: list[str] | None, req: CompletionRequest,
    ) -> AsyncIterator[bytes]:
        trackers = {(i, j): DeltaTracker(p) for i, p in enumerate(params) for j in range(p.n)}
        finals: dict[int, RequestOutput] = {}
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT}
        encoder = ChunkEncoder(head)
        encode, running_text = encoder.choice, encoder.running_text
        echo_only = req.echo and req.max_tokens == 0
        continuous = req.continuous_usage
        # Chunks that only carry text (most of them) take the encoder's short path.
        text_only = req.logprobs is None and not continuous
        try:
            async for i, out in self.merged(streams):
                if echo_only:
                    out = _without_generation(out)
                for comp in out.outputs:
                    tracker = trackers[(i, comp.index)]
                    first = tracker.num_tokens == 0 and tracker.num_chars == 0
                    delta, start, end = tracker.step(comp)
                    offset = len(echo_texts[i]) if first and echo_texts else 0
                    logprobs = self._logprobs(comp, start, end, offset, req) if req.logprobs is not None else None
                    if first and echo_texts:
                        delta = echo_texts[i] + delta
                        if logprobs is not None:
                            logprobs = self._with_echo(prompts[i][1], out.prompt_logprobs, logprobs, req)
                    if not delta and comp.finish_reason is None and (req.logprobs is None or start == end):
                        continue
                    if text_only and comp.finish_reason is None and not (first and req.prompt_logprobs is not None):
                        yield running_text(i * req.n + comp.index, delta)
                        continue
                    choice = {
                        "index": i * req.n + comp.index,
                        "text": delta,
                        "logprobs": logprobs,
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                    }
                    if first and req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                    # continuous_usage_stats: this prompt's tokens and this choice's tokens so far (vLLM's)
                    yield encode(choice, running_usage(len(prompts[i][1]), end) if continuous else None)
                if out.finished:
                    finals[i] = out
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": self.usage([len(ids) for _, ids in prompts],
                                                                      list(finals.values()))})
            timings = self._timings([finals[i] for i in sorted(finals)])
            if timings:  # its own last chunk, no choices (as the usage chunk)
                yield sse({**head, "choices": [], **timings})
        except Exception as exc:  # the engine failed this request: tell the client in-band
            yield self.error_event(exc)
        finally:
            for s in streams:
                s.abort()
        yield DONE

    @staticmethod
    def _logprobs(comp: CompletionOutput, start: int, end: int, offset: int, req: CompletionRequest) -> dict[str, list]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        entries = comp.logprobs or []
        for k in range(start, min(end, len(entries))):
            entry = entries[k]
            chosen = entry.get(comp.token_ids[k])
            tok = chosen.decoded_token or "" if chosen is not None else ""
            tokens.append(req.logprob_token(comp.token_ids[k], tok))
            token_logprobs.append(_lp(chosen.logprob) if chosen is not None else None)
            top.append({req.logprob_token(t, e.decoded_token or ""): _lp(e.logprob) for t, e in entry.items()})
            text_offset.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}

    def _with_echo(self, prompt_ids: list[int], entries: list | None, logprobs: dict[str, list],
                   req: CompletionRequest) -> dict[str, list]:
        """The echoed prompt's tokens first, each with its logprob and top n (the first token
        has none: nothing precedes it), then the completion's."""
        toks = self.state.tokenizer.batch_decode([[t] for t in prompt_ids])
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for p, token in enumerate(prompt_ids):
            entry = entries[p] if entries is not None else None
            chosen = entry.get(token) if entry else None
            token_lps.append(_lp(chosen.logprob) if chosen is not None else None)
            tops.append({req.logprob_token(t, e.decoded_token or ""): _lp(e.logprob) for t, e in entry.items()}
                        if entry else None)
        return {
            "tokens": [req.logprob_token(t, s) for t, s in zip(prompt_ids, toks)] + logprobs["tokens"],
            "token_logprobs": token_lps + logprobs["token_logprobs"],
            "top_logprobs": tops + logprobs["top_logprobs"],
            "text_offset": offsets + logprobs["text_offset"],
        }


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's shape: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None if e is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                                for t, lp in e.items()}
        for e in entries
    ]


def _without_generation(out: RequestOutput) -> RequestOutput:
    """echo with max_tokens 0: the one token the engine had to sample is not the client's."""
    comps = [replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None, cumulative_logprob=0.0,
                     finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)
             for c in out.outputs]
    return replace(out, outputs=comps)
