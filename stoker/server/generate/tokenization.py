"""The server's tokenizer work, off the event loop, and bounded by max_model_len.

Tokenizing or chat-templating a large body on the event loop froze `/health` and every stream
for 9-17 s (a 13-15 MB prompt; issue 20), and the full tokenization of such a prompt grew the
process by 2.7 GB. So:

* encoding, chat templating and decoding run on one worker thread of their own (HF fast
  tokenizers are not meant to be shared between threads, and the engine thread has its own);
* a prompt whose text is longer than `(max_model_len + 2) * max_chars_per_token` characters
  is first tokenized only that far: if that prefix alone is over max_model_len + 1 tokens, the
  prompt cannot fit and is refused (400) without tokenizing the rest. `max_chars_per_token`
  is the longest vocabulary entry, so a prefix that long holds at least max_model_len + 2
  tokens unless the tokenizer's normalizer deletes characters; then the whole text is
  tokenized after all, and the ordinary length check decides.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from stoker.engine.input_processor import EngineRequest, InputProcessor
from stoker.engine.llm import render_chat_text
from stoker.server.errors import bad_request
from stoker.sampling_params import SamplingParams
from stoker.server.generate.protocol import ChatMessage, message_dicts

T = TypeVar("T")


@dataclass(frozen=True)
class ChatRenderOptions:
    """A chat request's say in how its prompt is written (vLLM's extra chat fields)."""

    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # the request's own (the server allows it or refuses first)
    add_special_tokens: bool = False
    truncate_prompt_tokens: int | None = None  # set: the prompt is not refused for length before truncation
    # more variables for the template: chat_template_kwargs and reasoning_effort (vLLM's)
    template_kwargs: dict[str, Any] | None = None


class ServerTokenizer:
    def __init__(self, tokenizer: Any, max_model_len: int, input_processor: InputProcessor | None = None) -> None:
        """input_processor: the engine's request checks, built with this same tokenizer (it
        runs on this thread)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.input_processor = input_processor
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_chars_per_token = max((len(t) for t in vocab), default=64) or 1
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stoker-tokenizer")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ on the worker thread
    def encode_bounded(self, text: str, add_special_tokens: bool = True, param: str = "prompt",
                       bounded: bool = True) -> list[int]:
        """bounded False (truncate_prompt_tokens): the whole text is tokenized, its end is kept."""
        limit = self.max_model_len
        head_chars = (limit + 2) * self.max_chars_per_token
        if bounded and len(text) > head_chars:
            head = self.tokenizer.encode(text[:head_chars], add_special_tokens=add_special_tokens)
            # The cut may split the last token: the whole text has at least len(head) - 1.
            if len(head) - 1 > limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your prompt has at least "
                    f"{len(head) - 1} tokens ({len(text)} characters). Please reduce the length of the prompt.", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None,
                     options: ChatRenderOptions | None = None) -> tuple[list[int], str]:
        o = options or ChatRenderOptions()
        try:
            text = render_chat_text(self.tokenizer, message_dicts(messages), add_generation_prompt, o.chat_template,
                                    tools=tools, continue_final_message=o.continue_final_message, documents=o.documents,
                                    template_kwargs=o.template_kwargs)
        except Exception as exc:  # unsupported parts, jinja2 TemplateError (raise_exception in templates), ValueError
            raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None
        # The template writes BOS itself where the model wants one (add_special_tokens: on top of it).
        return self.encode_bounded(text, add_special_tokens=o.add_special_tokens, param="messages",
                                   bounded=o.truncate_prompt_tokens is None), text

    # ------------------------------------------------------------------ from the event loop
    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt",
                     bounded: bool = True) -> list[int]:
        return await self._run(self.encode_bounded, text, add_special_tokens, param, bounded)

    async def encode_all(self, texts: list[str], add_special_tokens: bool = True, bounded: bool = True) -> list[list[int]]:
        return await self._run(lambda: [self.encode_bounded(t, add_special_tokens, bounded=bounded) for t in texts])

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None, options: ChatRenderOptions | None = None) -> list[int]:
        """tools: OpenAI's tool definitions, for templates that render them."""
        ids, _ = await self._run(self._render_chat, messages, add_generation_prompt, tools, options)
        return ids

    async def render_chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                                 tools: list[dict[str, Any]] | None = None,
                                 options: ChatRenderOptions | None = None) -> tuple[list[int], str]:
        """(ids, text) of the rendered prompt (a reasoning parser reads how the prompt ends)."""
        return await self._run(self._render_chat, messages, add_generation_prompt, tools, options)

    async def decode(self, ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, ids)

    async def engine_requests(self, items: list[tuple[str, str | None, list[int], SamplingParams]],
                              lora_name: str | None, priority: int = 0, cache_salt: str | None = None
                              ) -> list[EngineRequest]:
        """(request id, prompt text, prompt ids, params) -> checked engine requests (the grammar
        compiled, bad_words tokenized); a request the engine cannot run is a 400 naming its field."""
        assert self.input_processor is not None, "this server has no generative engine"
        process = self.input_processor.process

        def build() -> list[EngineRequest]:
            return [process(rid, text, params, ids, lora_name=lora_name, priority=priority, cache_salt=cache_salt)
                    for rid, text, ids, params in items]

        try:
            return await self._run(build)
        except ValueError as exc:  # an InputError names its field
            raise bad_request(str(exc), getattr(exc, "param", None)) from None
