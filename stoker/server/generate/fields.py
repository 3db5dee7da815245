"""What this server answers to each request field vLLM accepts, as one table. [no torch]

Clients written against vLLM send its extension fields beside OpenAI's. A field the server
does not honour must be refused with a 400 that names it, never accepted and ignored, so
every field vLLM's `/v1/completions` and `/v1/chat/completions` take has a row here:

* `honoured`: the server does what the field asks (`how` says where);
* `refused`: a value that asks for behaviour (`asks(value)` is true) is a 400 naming the
  field and saying why; the field's no-op value (its default) is accepted.

`refusals(data, endpoint)` is what the request models call before validation; the table
in docs/server.md ("Request fields") lists the same rows and a test walks them
(tests/server/test_request_fields.py: each refused row's `sample` gets a 400 naming it,
each honoured row's `sample` a 200). Fields neither OpenAI nor vLLM defines are ignored,
as both do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]
BOTH: tuple[Endpoint, ...] = ("completions", "chat")


@dataclass(frozen=True)
class FieldRule:
    name: str
    endpoints: tuple[Endpoint, ...]
    answer: Literal["honoured", "refused"]
    how: str  # honoured: what it does here; refused: why, and what to send instead
    sample: Any  # a value that asks for the field's behaviour (tests send it; None: tested on its own)
    asks: Callable[[Any], bool] | None = None  # refused rows: does this value ask for behaviour
    with_: tuple[tuple[str, Any], ...] = ()  # fields the sample needs beside it (top_logprobs: logprobs)

    def refuses(self, value: Any) -> bool:
        return self.answer == "refused" and self.asks is not None and self.asks(value)


def _set(v: Any) -> bool:
    return v not in (None, False, [], {}, "")


def _ok(name: str, endpoints: tuple[Endpoint, ...], how: str, sample: Any, **with_: Any) -> FieldRule:
    return FieldRule(name, endpoints, "honoured", how, sample, None, tuple(with_.items()))


def _no(name: str, endpoints: tuple[Endpoint, ...], why: str, sample: Any, asks: Callable[[Any], bool] = _set) -> FieldRule:
    return FieldRule(name, endpoints, "refused", why, sample, asks)


RULES: tuple[FieldRule, ...] = (
    # ---- OpenAI's fields
    _ok("model", BOTH, "picks the served model or LoRA adapter", None),
    _ok("n", BOTH, "n completions per prompt, sharing the prompt's KV blocks", 2),
    _ok("temperature", BOTH, "sampling temperature (0: greedy)", 0.5),
    _ok("top_p", BOTH, "nucleus sampling", 0.9),
    _ok("max_tokens", BOTH, "output length cap (chat: deprecated alias of max_completion_tokens)", 3),
    _ok("max_completion_tokens", ("chat",), "output length cap", 3),
    _ok("presence_penalty", BOTH, "OpenAI's presence penalty", 0.5),
    _ok("frequency_penalty", BOTH, "OpenAI's frequency penalty", 0.5),
    _ok("logit_bias", BOTH, "added to the logits before sampling", {"5": 1.0}),
    _ok("logprobs", ("completions",), "the top n logprobs per token", 2),
    _ok("logprobs", ("chat",), "per-token logprobs", True),
    _ok("top_logprobs", ("chat",), "top n alternatives per token (with logprobs true)", 2, logprobs=True),
    _ok("seed", BOTH, "per-request generator: the same seed gives the same tokens", 7),
    _ok("stop", BOTH, "stop strings (the text is cut before them unless include_stop_str_in_output)", ["\n\n"]),
    _ok("stream", BOTH, "server-sent events", True),
    _ok("stream_options", BOTH, "include_usage: usage in a last chunk; continuous_usage_stats: usage in every chunk",
        {"include_usage": True, "continuous_usage_stats": True}),
    _ok("response_format", BOTH, "text, json_object or json_schema, enforced with xgrammar", {"type": "json_object"}),
    _ok("tools", ("chat",), "rendered by the chat template; calls parsed (--tool-call-parser) or enforced",
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], tool_choice="none"),
    _ok("tool_choice", ("chat",), "none, auto (needs --enable-auto-tool-choice), required or a named function",
        "required", tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    _ok("parallel_tool_calls", ("chat",), "false: at most one call (required: by the grammar; auto: the first call parsed)", False),
    _ok("user", BOTH, "OpenAI's end-user id for abuse monitoring: it never changes the output", "u-1"),
    _ok("echo", ("completions",), "the prompt is returned before the completion (with its logprobs)", True),
    _ok("echo", ("chat",), "the last message's content is put before the reply when it is the assistant's "
                           "(with continue_final_message)", True),
    _no("best_of", ("completions",), "best_of > 1 is not supported; use n", 2, lambda v: v not in (None, 1)),
    _no("suffix", ("completions",), "suffix (insertion) is not supported; omit it", "x"),
    _no("functions", ("chat",), "the deprecated functions field is not supported; send tools instead",
        [{"name": "f", "parameters": {"type": "object"}}]),
    _no("function_call", ("chat",), "the deprecated function_call field is not supported; send tool_choice instead",
        {"name": "f"}, lambda v: v not in (None, "none")),
    _ok("reasoning_effort", ("chat",), "passed to the chat template as `reasoning_effort` (gpt-oss's template reads it)",
        "low"),
    _no("audio", ("chat",), "audio output is not supported (text only)", {"voice": "alloy", "format": "wav"}),
    _no("modalities", ("chat",), "only text output is supported; send ['text'] or omit modalities", ["audio"],
        lambda v: _set(v) and v != ["text"]),
    _no("prediction", ("chat",), "predicted outputs are not supported; omit prediction",
        {"type": "content", "content": "x"}),
    _no("web_search_options", ("chat",), "there is no web search here; omit web_search_options", {}, lambda v: v is not None),
    _no("store", ("chat",), "nothing is stored here; send store false or omit it", True, lambda v: v is True),
    _no("service_tier", BOTH, "there is one service tier; send auto or default, or omit it", "flex",
        lambda v: v not in (None, "auto", "default")),
    # ---- vLLM's sampling extensions
    _ok("top_k", BOTH, "top-k sampling (0 or -1: off)", 5),
    _ok("min_p", BOTH, "min-p sampling", 0.05),
    _ok("repetition_penalty", BOTH, "multiplicative penalty on seen tokens", 1.1),
    _ok("stop_token_ids", BOTH, "stop on these token ids", [3]),
    _ok("include_stop_str_in_output", BOTH, "the stop string stays in the text", True),
    _ok("ignore_eos", BOTH, "keep generating past EOS", True),
    _ok("min_tokens", BOTH, "EOS and stop tokens are masked until this many tokens", 1),
    _ok("skip_special_tokens", BOTH, "special tokens left out of the text", False),
    _ok("truncate_prompt_tokens", BOTH, "keep only the last k prompt tokens (-1: max_model_len)", 4),
    _ok("prompt_logprobs", BOTH, "each prompt token's logprob and top n (not with stream)", 1),
    _ok("allowed_token_ids", BOTH, "sampling only among these ids", [3, 4, 5]),
    _ok("bad_words", BOTH, "these words are never completed", ["zzz"]),
    _no("use_beam_search", BOTH, "beam search is not supported; sample with n instead", True),
    _no("length_penalty", BOTH, "length_penalty applies to beam search only, which is not supported; omit it", 0.5,
        lambda v: v not in (None, 1, 1.0)),
    _no("spaces_between_special_tokens", BOTH, "special tokens are decoded as the fast tokenizer writes them; "
        "false is not supported", False, lambda v: v is False),
    # ---- vLLM's extra parameters
    _ok("add_special_tokens", BOTH, "the tokenizer's special tokens (BOS) added to the prompt "
        "(completions: default true; chat: default false, the template writes them)", False),
    _ok("add_generation_prompt", ("chat",), "the template's assistant header at the end", False),
    _ok("continue_final_message", ("chat",), "the last (assistant) message is left open for the model to continue "
        "(not with add_generation_prompt)", True, add_generation_prompt=False,
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]),
    _ok("chat_template_kwargs", ("chat",), "more variables for the chat template (e.g. enable_thinking); names the "
        "server sets itself are refused", {"enable_thinking": False}),
    _ok("include_reasoning", ("chat",), "false: the reasoning split out by --reasoning-parser is dropped", False),
    _ok("documents", ("chat",), "passed to the chat template as `documents` (RAG templates render them)",
        [{"title": "t", "text": "x"}]),
    _ok("chat_template", ("chat",), "a request's own Jinja template, only with --trust-request-chat-template "
        "(else refused)", None),
    _ok("structured_outputs", BOTH, "json, json_object, regex, choice or grammar, enforced with xgrammar",
        {"choice": ["a", "b"]}),
    _ok("guided_json", BOTH, "as structured_outputs.json", {"type": "object"}),
    _ok("guided_regex", BOTH, "as structured_outputs.regex", "a+"),
    _ok("guided_choice", BOTH, "as structured_outputs.choice", ["a", "b"]),
    _ok("guided_grammar", BOTH, "as structured_outputs.grammar (EBNF)", 'root ::= "a"'),
    _no("guided_decoding_backend", BOTH, "structured outputs run on xgrammar only; send xgrammar or auto, or omit it",
        "outlines", lambda v: v not in (None, "", "xgrammar", "auto")),
    _no("guided_whitespace_pattern", BOTH, "the JSON whitespace rule is xgrammar's; a custom pattern is not supported",
        "[ ]?"),
    _no("structural_tag", BOTH, "structural tags are not supported; use tools with tool_choice or a JSON schema",
        '{"structures": []}'),
    _ok("priority", BOTH, "with --scheduling-policy priority: lower runs first (admission and preemption); "
        "non-zero without it is refused", 0),
    _ok("request_id", BOTH, "the response id is the endpoint's prefix and this id", "my-req-1"),
    _no("logits_processors", BOTH, "custom logits processors are not loaded by this server; omit logits_processors",
        ["my_module.Processor"]),
    _ok("return_tokens_as_token_ids", BOTH, "logprob tokens written as 'token_id:{id}'", True),
    _ok("cache_salt", BOTH, "the prefix cache is shared only between requests with the same salt", "tenant-a"),
    _ok("kv_transfer_params", BOTH, "disaggregated prefill/decode legs (vLLM's keys) with --kv-transfer-config; "
        "a 400 naming it without (docs/disaggregation.md)", None),
    _no("vllm_xargs", BOTH, "no custom extension reads vllm_xargs here; omit it", {"k": 1}),
    _no("mm_processor_kwargs", ("chat",), "the engine is text-only: no multimodal processor runs", {"num_crops": 4}),
    _no("prompt_embeds", ("completions",), "prompt embeddings are not accepted; send text or token ids", "AAAA"),
)

_REFUSERS: dict[Endpoint, tuple[FieldRule, ...]] = {
    e: tuple(r for r in RULES if e in r.endpoints and r.answer == "refused") for e in BOTH
}


def refusals(data: dict[str, Any], endpoint: Endpoint) -> list[tuple[str, str]]:
    """(field, why) for each field of `data` that asks for something this server does not do."""
    return [(r.name, r.how) for r in _REFUSERS[endpoint] if r.name in data and r.refuses(data[r.name])]
