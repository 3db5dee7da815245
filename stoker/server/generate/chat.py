"""POST /v1/chat/completions: messages through the model's chat template -> assistant choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stoker.outputs import CompletionOutput, RequestOutput
from stoker.sampling_params import SamplingParams
from stoker.server.errors import ApiError, bad_request
from stoker.server.generate.protocol import ChatCompletionRequest, ToolChoiceError
from stoker.server.generate.completion import prompt_logprobs_json
from stoker.server.generate.serving import (DONE, SYSTEM_FINGERPRINT, ChunkEncoder, DeltaTracker, Serving, now_s,
                                            response_id, running_usage, sse)
from stoker.server.generate.tokenization import ChatRenderOptions
from stoker.server.generate.reasoning_output import ReasoningPlan
from stoker.server.generate.tools.calls import ToolPlan

_MIN_LOGPROB = -9999.0  # -inf is not JSON


class OpenAIServingChat(Serving):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.state.check_model(req.model)
        self.state.ready_engine()
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs are not available when stream is true (as vLLM); send stream false",
                              "prompt_logprobs")
        try:
            req.tool_constraint()  # checked before the (slower) templating; sampling_params builds it again
        except ToolChoiceError as exc:
            raise bad_request(str(exc), exc.param) from None
        plan = ToolPlan.of(req, self.state.settings)
        options = self._render_options(req)
        ids, prompt_text = await self.state.tokenization.render_chat_prompt(
            req.messages, req.add_generation_prompt and not req.continue_final_message, req.template_tools(), options)
        try:
            ids = req.truncated(ids, self.state.max_model_len)
        except ValueError as exc:
            raise bad_request(str(exc), "truncate_prompt_tokens") from None
        echo = _echoed(req)
        thinking = ReasoningPlan.of(self.state.settings.reasoning_parser, req.include_reasoning, prompt_text)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(ids), asked, param)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, num_logprobs)
        if plan.mode == "auto" and plan.parser is not None and plan.parser.keeps_special_tokens:
            # As vLLM's parsers ask: tokenizers that mark the format's markers (<tool_call>,
            # [TOOL_CALLS], ...) special would otherwise drop what the parser looks for (the EOS
            # adds no text either way).
            params.skip_special_tokens = False
        if thinking.keeps_special_tokens:  # <think> or harmony's markers may be special tokens
            params.skip_special_tokens = False
        if thinking.end_marker is not None and params.structured_outputs is not None:
            # The grammar is for the answer: the thinking before the end marker stays free.
            marker = await self.state.tokenization.encode(thinking.end_marker, add_special_tokens=False)
            params.structured_outputs = replace(params.structured_outputs, enforce_after=tuple(marker))
        request_id, engine_id = response_id("chatcmpl", req.request_id)
        try:
            streams = await self.add_all(engine_id, [(None, ids)], [params], lora_name=self.state.lora_name(req.model),
                                         req=req)
        except ApiError as exc:
            if plan.mode in ("named", "required") and exc.param in ("response_format", "structured_outputs"):
                raise bad_request(f"tools: {exc.message}", "tools") from None  # the grammar came from the tools
            raise
        created = now_s()
        if req.stream:
            body = self._stream(request_id, model, created, streams, params, len(ids), req, plan, thinking, echo)
            return StreamingResponse(body, media_type="text/event-stream")
        (out,) = await self.until_disconnect(raw, self.collect(streams))
        choices = []
        for comp in out.outputs:
            reasoning, content = thinking.split(comp.text)
            message, finish_reason = plan.message(content or "", comp.finish_reason)
            if content is None and plan.mode in ("plain", "auto") and message["content"] == "":
                message["content"] = None  # all of it was thinking (vLLM: no content)
            if echo and isinstance(message.get("content"), str):
                message["content"] = echo + message["content"]
            choices.append({
                "index": comp.index,
                "message": {**message, **thinking.fields(reasoning)},
                "logprobs": self._logprobs(comp, 0, len(comp.token_ids), req) if req.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": comp.stop_reason,
            })
        return JSONResponse({
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": self.usage([len(ids)], [out]),
            **({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)} if req.prompt_logprobs is not None else {}),
            **_timing_field(self.timing(out)),
            **({"kv_transfer_params": out.kv_transfer_params} if out.kv_transfer_params else {}),
        })

    async def _stream(
        self, request_id: str, model: str, created: int, streams: list, params: SamplingParams,
        prompt_len: int, req: ChatCompletionRequest, plan: ToolPlan, thinking: ReasoningPlan, echo: str = "",
    ) -> AsyncIterator[bytes]:
        trackers = [DeltaTracker(params) for _ in range(params.n)]
        tool_streams = [plan.stream() for _ in range(params.n)]
        reasoning_streams = [thinking.stream() for _ in range(params.n)]
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT}
        encoder = ChunkEncoder(head)
        encode, running_content = encoder.choice, encoder.running_content
        # continuous_usage_stats: every chunk carries the prompt's tokens and its choice's so far
        continuous = req.continuous_usage
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
                                      "finish_reason": None}, running_usage(prompt_len, 0) if continuous else None)
                        if echo:  # the message the reply continues, as its first content
                            yield encode({"index": j, "delta": {"content": echo}, "logprobs": None,
                                          "finish_reason": None}, running_usage(prompt_len, 0) if continuous else None)
                for comp in out.outputs:
                    delta, start, end = trackers[comp.index].step(comp)
                    finished = comp.finish_reason is not None
                    tools = tool_streams[comp.index]
                    # reasoning, then content and tool-call deltas from what follows the thinking; both
                    # streams may hold text back (a marker or a call not yet complete)
                    reasoning, delta = reasoning_streams[comp.index].step(delta, finished)
                    pieces = tools.step(delta, finished)
                    if reasoning is not None:
                        pieces.insert(0, reasoning)
                    want_lp = bool(req.logprobs) and end > start
                    if not pieces and not finished and not want_lp:
                        continue
                    if not pieces:
                        pieces = [{"content": ""} if not finished else {}]
                    if not finished and not req.logprobs and not continuous and len(pieces) == 1:
                        text = pieces[0].get("content")
                        if type(text) is str and len(pieces[0]) == 1:  # content alone (most chunks): the short path
                            yield running_content(comp.index, text)
                            continue
                    for k, piece in enumerate(pieces):
                        last = k == len(pieces) - 1
                        choice = {
                            "index": comp.index,
                            "delta": piece,
                            "logprobs": self._logprobs(comp, start, end, req) if req.logprobs and k == 0 else None,
                            "finish_reason": plan.finish_reason(comp.finish_reason, tools.called) if last else None,
                        }
                        if finished and last:
                            choice["stop_reason"] = comp.stop_reason
                        yield encode(choice, running_usage(prompt_len, end) if continuous else None)
                if out.finished:
                    final = out
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": self.usage([prompt_len], [final] if final else [])})
            timing = self.timing(final)
            if timing is not None:  # its own last chunk, no choices (as the usage chunk)
                yield sse({**head, "choices": [], "stoker_timing": timing})
        except Exception as exc:  # the engine failed this request: tell the client in-band
            yield self.error_event(exc)
        finally:
            for s in streams:
                s.abort()
        yield DONE

    def _render_options(self, req: ChatCompletionRequest) -> ChatRenderOptions:
        """How the request writes its prompt; a request's own chat_template only where the server
        trusts them (vLLM's --trust-request-chat-template: a template is code the server runs)."""
        if req.chat_template is not None and not self.state.settings.trust_request_chat_template:
            raise bad_request("chat_template: this server does not run templates sent in requests; start it with "
                              "--trust-request-chat-template, or omit chat_template", "chat_template")
        if req.continue_final_message:
            if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
                raise bad_request("continue_final_message and add_generation_prompt cannot both be true: the reply "
                                  "either continues the last message or starts a new one", "continue_final_message")
            if not req.messages or req.messages[-1].role != "assistant":
                raise bad_request("continue_final_message needs an assistant message last, to continue",
                                  "continue_final_message")
        return ChatRenderOptions(continue_final_message=req.continue_final_message, documents=req.documents,
                                 chat_template=req.chat_template, add_special_tokens=req.add_special_tokens,
                                 truncate_prompt_tokens=req.truncate_prompt_tokens, template_kwargs=req.template_kwargs())

    @staticmethod
    def _logprobs(comp: CompletionOutput, start: int, end: int, req: ChatCompletionRequest) -> dict[str, list]:
        top_n = req.top_logprobs or 0
        content = []
        entries = comp.logprobs or []
        for k in range(start, min(end, len(entries))):
            entry = entries[k]
            chosen = entry.get(comp.token_ids[k])
            tok = req.logprob_token(comp.token_ids[k], (chosen.decoded_token or "") if chosen is not None else "")
            ranked = sorted(((t, e) for t, e in entry.items() if e.rank is not None and e.rank <= top_n),
                            key=lambda te: te[1].rank)
            top = [(req.logprob_token(t, e.decoded_token or ""), e.logprob) for t, e in ranked[:top_n]]
            content.append({
                "token": tok,
                "logprob": max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else _MIN_LOGPROB,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": max(lp, _MIN_LOGPROB), "bytes": list(t.encode("utf-8"))}
                                 for t, lp in top],
            })
        return {"content": content}


def _echoed(req: ChatCompletionRequest) -> str:
    """echo (vLLM's): the reply is put after the last message's text when that message is the
    assistant's (the one the model continues), else nothing is echoed."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):
        return "\n".join(p.text for p in content if hasattr(p, "text"))
    return content or ""


def _timing_field(timing: dict | None) -> dict:
    return {"stoker_timing": timing} if timing is not None else {}
