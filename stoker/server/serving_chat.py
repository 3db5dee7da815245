"""POST /v1/chat/completions: messages through the model's chat template -> assistant choices."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stoker.outputs import CompletionOutput, RequestOutput
from stoker.sampling_params import SamplingParams
from stoker.server.errors import bad_request
from stoker.server.protocol import ChatCompletionRequest
from stoker.server.serving import DONE, SYSTEM_FINGERPRINT, ChunkEncoder, DeltaTracker, Serving, new_id, now_s, sse

_MIN_LOGPROB = -9999.0  # -inf is not JSON


class OpenAIServingChat(Serving):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        self.engine()
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        ids = await self.state.tokenization.render_chat(req.messages, req.add_generation_prompt)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(ids), asked, param)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, num_logprobs)
        await self.compile_grammar(params)
        request_id = new_id("chatcmpl")
        streams = self.add_all(request_id, [(None, ids)], [params])
        created = now_s()
        if req.stream:
            body = self._stream(request_id, model, created, streams, params, len(ids), req)
            return StreamingResponse(body, media_type="text/event-stream")
        (out,) = await self.until_disconnect(raw, self.collect(streams))
        choices = [
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": self._logprobs(comp, 0, len(comp.token_ids), req.top_logprobs or 0) if req.logprobs else None,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            for comp in out.outputs
        ]
        return JSONResponse({
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": self.usage([len(ids)], [out]),
        })

    async def _stream(
        self, request_id: str, model: str, created: int, streams: list, params: SamplingParams,
        prompt_len: int, req: ChatCompletionRequest,
    ) -> AsyncIterator[bytes]:
        trackers = [DeltaTracker(params) for _ in range(params.n)]
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT}
        encode = ChunkEncoder(head).choice
        final: RequestOutput | None = None
        try:
            role_sent = False
            async for _, out in self.merged(streams):
                if not role_sent:
                    # The role goes first, once per choice, as OpenAI streams it, but only with
                    # the first output (after the prefill, as vLLM sends it): a client's
                    # time-to-first-token is the first token's, not the request's arrival.
                    role_sent = True
                    for j in range(params.n):
                        yield encode({"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None})
                for comp in out.outputs:
                    delta, start, end = trackers[comp.index].step(comp)
                    want_lp = bool(req.logprobs) and end > start
                    if not delta and comp.finish_reason is None and not want_lp:
                        continue
                    choice = {
                        "index": comp.index,
                        "delta": {"content": delta} if delta or comp.finish_reason is None else {},
                        "logprobs": self._logprobs(comp, start, end, req.top_logprobs or 0) if req.logprobs else None,
                        "finish_reason": comp.finish_reason,
                    }
                    if comp.finish_reason is not None:
                        choice["stop_reason"] = comp.stop_reason
                    yield encode(choice)
                if out.finished:
                    final = out
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": self.usage([prompt_len], [final] if final else [])})
        except Exception as exc:  # the engine failed this request: tell the client in-band
            yield self.error_event(exc)
        finally:
            for s in streams:
                s.abort()
        yield DONE

    @staticmethod
    def _logprobs(comp: CompletionOutput, start: int, end: int, top_n: int) -> dict[str, list]:
        content = []
        entries = comp.logprobs or []
        for k in range(start, min(end, len(entries))):
            entry = entries[k]
            chosen = entry.get(comp.token_ids[k])
            tok = (chosen.decoded_token or "") if chosen is not None else ""
            ranked = sorted((e for e in entry.values() if e.rank is not None and e.rank <= top_n), key=lambda e: e.rank)
            content.append({
                "token": tok,
                "logprob": max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else _MIN_LOGPROB,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": e.decoded_token or "", "logprob": max(e.logprob, _MIN_LOGPROB),
                     "bytes": list((e.decoded_token or "").encode("utf-8"))}
                    for e in ranked[:top_n]
                ],
            })
        return {"content": content}
