"""SamplingParams: what to generate and when to stop, validated up front. [no torch]

Names and defaults follow vLLM's `SamplingParams` so existing scripts port; valid ranges
follow the OpenAI API as vLLM serves it (../shared/reference/facts.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.structured.spec import StructuredOutputs

# Greedy below this temperature: dividing logits by ~0 overflows, and users mean "argmax".
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top log-probabilities per output token
    # vLLM's name: per prompt token (the first has none), its log-probability and the top n.
    # The prompt of such a request is computed in full (no prefix-cache hit: a cached block
    # has no logits), in chunks of rows so a long prompt never holds (prompt_len, vocab).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before sampling
    # (the reported logprobs stay the model's, as vLLM V1 reports them).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM: only these may be sampled
    bad_words: list[str] | None = None  # vLLM: words never completed (their last token banned after the rest)
    # vLLM's structured_outputs: the output follows a JSON schema, JSON, a regex, a choice or a grammar
    structured_outputs: StructuredOutputs | None = None
    # vLLM's kv_transfer_params: disaggregated prefill/decode (stoker/kv_transfer/params.py)
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, valid: str) -> ValueError:
            return ValueError(f"{name} must be {valid}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0 or self.temperature > 2:
            raise bad("temperature", self.temperature, "in [0, 2]")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "-1 or 0 (off) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 (or None for up to the context limit)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.structured_outputs is not None:
            # Each of these can leave a step with no token both it and the grammar allow (the
            # grammar may allow only EOS, or only tokens they ban): refused, not failed mid-batch.
            for name, conflicts in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens > 0),
                                    ("allowed_token_ids", self.allowed_token_ids is not None),
                                    ("bad_words", bool(self.bad_words))):
                if conflicts:
                    raise ValueError(f"{name} cannot be combined with structured_outputs: the grammar decides which "
                                     "tokens may come and where the output ends")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer >= 0 (0: the prompt token's own only)")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            if any(t < 0 or not -100 <= v <= 100 for t, v in self.logit_bias.items()):
                raise bad("logit_bias", self.logit_bias, "a map of token ids to values in [-100, 100]")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of non-negative token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", self.bad_words, "a list of non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
