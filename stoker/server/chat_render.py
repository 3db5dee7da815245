"""Chat messages -> prompt token ids through the model's chat template."""

from __future__ import annotations

from typing import Any

from stoker.engine.llm import apply_chat_template
from stoker.server.errors import bad_request
from stoker.server.protocol import ChatMessage, message_dicts


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Token ids of the conversation; template or content problems are the client's (400)."""
    try:
        return apply_chat_template(tokenizer, message_dicts(messages), add_generation_prompt)
    except Exception as exc:  # jinja2 TemplateError (raise_exception in templates), ValueError
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None
