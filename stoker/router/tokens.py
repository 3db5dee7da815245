"""Prompt length in tokens, for the local-or-remote prefill decision. [no torch]

With `--tokenizer DIR` the router counts with a local Hugging Face tokenizer (no round trip);
otherwise it asks the decode server's `/tokenize` (vLLM's endpoint, which `stoker serve`
serves for prompts and for chat messages with the server's own chat template). If neither
answers, the UTF-8 length / 4 stands in (about four bytes per token for English text with
the common BPE vocabularies) and the miss is counted as an upstream error.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from stoker.router.http1 import HTTP1Pool, UpstreamConnectionError
from stoker.router.requests import token_ids_of

_JSON = {"content-type": "application/json"}


class LocalTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # only with --tokenizer: the router stays light without it

        self.tok = AutoTokenizer.from_pretrained(path)

    def count(self, body: dict[str, Any], chat: bool) -> int:
        if chat:
            ids = self.tok.apply_chat_template(body.get("messages") or [], add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # newer transformers return a BatchEncoding
                ids = ids["input_ids"]
            return len(ids)
        prompt = body.get("prompt")
        text = prompt[0] if isinstance(prompt, list) and prompt else prompt
        return len(self.tok(str(text or ""))["input_ids"])


async def count_tokens(body: dict[str, Any], chat: bool, text: str, http: HTTP1Pool, local: LocalTokenizer | None,
                       timeout_s: float) -> tuple[int, bool]:
    """(tokens, exact): exact is False when the estimate stood in for a failed count."""
    if not chat:
        ids = token_ids_of(body)
        if ids is not None:
            return len(ids), True
    if local is not None:
        try:
            if len(text) < 4096:
                return local.count(body, chat), True
            return await asyncio.to_thread(local.count, body, chat), True
        except Exception:  # a body the template cannot render: the server will say what is wrong
            return len(text.encode()) // 4, False
    payload: dict[str, Any] = {"model": body.get("model")}
    if chat:
        payload["messages"] = body.get("messages")
    else:
        prompt = body.get("prompt")
        payload["prompt"] = prompt[0] if isinstance(prompt, list) and prompt else prompt
    try:
        resp = await http.post("/tokenize", json.dumps(payload).encode(), _JSON, timeout_s)
        try:
            raw = await resp.read()
        finally:
            resp.release()
        if resp.status == 200:
            count = json.loads(raw).get("count")
            if isinstance(count, int):
                return count, True
    except (UpstreamConnectionError, asyncio.TimeoutError, ValueError, AttributeError):
        pass
    return len(text.encode()) // 4, False
