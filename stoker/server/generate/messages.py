"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, stateless, over
the chat path (as vLLM serves it).

The request becomes a chat-completions request (messages_protocol.py) and runs through
OpenAIServingChat unchanged, so templating, sampling, stop strings and tool calling (enforced
for `any` / `tool`, parsed for `auto`) exist once; its answer is re-shaped, as the Responses
API's is (responses.py). A chat.completion becomes a `message` with text and tool_use blocks;
a chat stream becomes Anthropic's events: message_start, ping, then per block
content_block_start / content_block_delta (text_delta, input_json_delta) / content_block_stop,
then message_delta (stop_reason, stop_sequence, usage) and message_stop. Errors leave in
Anthropic's shape (http/anthropic_errors.py).
"""

from __future__ import annotations

import json
import re

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stoker.server.errors import ApiError, bad_request, describe_validation_errors
from stoker.server.generate.chat import OpenAIServingChat
from stoker.server.generate.messages_answer import from_completion, message_events, message_id
from stoker.server.generate.protocol import ChatCompletionRequest
from stoker.server.generate.messages_protocol import CountTokensRequest, MessagesRequest
from stoker.server.generate.serving import Serving


class _PromptLengthChat(OpenAIServingChat):
    """The chat serving class, remembering the prompt's token count: Anthropic's stream states
    input_tokens in its first event, while the chat stream tells it only in its last chunk.
    resolve_max_tokens is where the chat path first knows it (once per request)."""

    prompt_len = 0

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, param: str = "max_tokens") -> int:
        self.prompt_len = prompt_len
        return super().resolve_max_tokens(prompt_len, max_tokens, param)


def _chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages body means, or a 400 naming the Messages field at fault."""
    try:
        return ChatCompletionRequest.model_validate(body.chat_body())
    except ValueError as exc:  # pydantic's ValidationError is a ValueError too
        if isinstance(exc, ValidationError):
            message, param = describe_validation_errors(exc.errors())
            raise bad_request(message, _messages_param(param)) from None
        field = re.match(r"[a-z_]+", str(exc))  # messages_protocol's messages start with the field
        raise bad_request(str(exc), field.group(0) if field else None) from None


def _messages_param(param: str | None) -> str | None:
    """A chat field named in an error, as the Messages request calls it."""
    return {"stop": "stop_sequences", "response_format": "output_config"}.get(param or "", param)


# The chat path's refusals name chat's values; a Messages client sent Anthropic's.
_CHAT_WORDS = (
    ("'none', 'required' or a named function", "type 'none', 'any' or 'tool'"),
    ("tool_choice 'required'", "tool_choice 'any'"),
    ("tool_choice a named function", "tool_choice 'tool'"),
    ("tool_choice names function", "tool_choice names tool"),
    ("tool_choice 'named'", "tool_choice 'tool'"),
    (".function.parameters", ".input_schema"),
    ("response_format, structured_outputs or guided_*", "output_config.format"),
)


def in_messages_terms(message: str) -> str:
    for chat_words, messages_words in _CHAT_WORDS:
        message = message.replace(chat_words, messages_words)
    return message


class AnthropicServingMessages(Serving):
    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        chat = _PromptLengthChat(self.state)
        try:
            answer = await chat.create(_chat_request(req), raw)
        except ApiError as exc:
            raise ApiError(exc.status, in_messages_terms(exc.message), _messages_param(exc.param), exc.headers) from None
        model = self.state.check_model(req.model)
        if isinstance(answer, StreamingResponse):
            events = message_events(message_id(), model, chat.prompt_len, answer.body_iterator)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(from_completion(message_id(), model, json.loads(bytes(answer.body))))

    async def count_tokens(self, req: CountTokensRequest) -> JSONResponse:
        """The prompt's tokens as the chat template renders it (tools included), as vLLM counts."""
        self.state.check_model(req.model)
        self.state.ready_engine()
        chat = _chat_request(req)
        ids = await self.state.tokenization.render_chat(chat.messages, True, chat.template_tools())
        return JSONResponse({"input_tokens": len(ids)})
