"""The input processor: a request is checked once, before the engine sees it (pure Python)."""

from __future__ import annotations

import pytest

from stoker.engine.input_processor import EngineRequest, InputError, InputLimits, InputProcessor
from stoker.sampling_params import SamplingParams
from stoker.structured.spec import StructuredOutputs


class WordTokenizer:
    """One id per character (a leading space is its own id): enough to check what is sent."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]


class Grammars:
    def __init__(self) -> None:
        self.compiled: list[StructuredOutputs] = []

    def compile(self, spec: StructuredOutputs) -> None:
        if spec.kind == "regex" and spec.regex == "(":
            raise ValueError("the regex constraint cannot be enforced: unbalanced")
        self.compiled.append(spec)


def processor(chunked: bool = True, loras: tuple[str, ...] | None = None, grammars: Grammars | None = None) -> InputProcessor:
    limits = InputLimits(vocab_size=100, max_model_len=16, max_num_batched_tokens=8, enable_chunked_prefill=chunked)
    has_lora = (lambda name: name in loras) if loras is not None else None
    cache = grammars or Grammars()
    return InputProcessor(WordTokenizer(), limits, has_lora, lambda: cache)


def test_a_checked_request_is_frozen_and_carries_what_the_engine_needs() -> None:
    req = processor(loras=("pong",)).process("r1", "hi", SamplingParams(bad_words=["ab"]), arrival_time=5.0,
                                             lora_name="pong")
    assert isinstance(req, EngineRequest)
    assert (req.prompt, req.prompt_token_ids, req.arrival_time, req.lora_name) == ("hi", [4, 5], 5.0, "pong")
    assert req.bad_words_token_ids == ((97, 98), (32, 97, 98))  # alone and after a space
    with pytest.raises(AttributeError):
        req.lora_name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "param", "match"), [
    ({"prompt_token_ids": [1, 100]}, "prompt", r"token ids must be in \[0, 100\); got \[100\]"),
    ({"prompt_token_ids": []}, "prompt", "the prompt is empty"),
    ({"prompt_token_ids": list(range(17))}, "prompt", "maximum context length is 16 tokens.*has 17 tokens"),
    ({"prompt_token_ids": [1], "params": SamplingParams(logit_bias={150: 1.0})}, "logit_bias", r"got \[150\]"),
    ({"prompt_token_ids": [1], "params": SamplingParams(allowed_token_ids=[3, 200])}, "allowed_token_ids", r"got \[200\]"),
    ({}, "prompt", "give a prompt string or prompt_token_ids"),
])
def test_refusals_name_the_field(kwargs: dict, param: str, match: str) -> None:
    with pytest.raises(InputError, match=match) as info:
        processor().process("r", **kwargs)
    assert info.value.param == param


def test_chunked_prefill_off_refuses_a_prompt_longer_than_a_step() -> None:
    processor(chunked=False).process("ok", prompt_token_ids=[1] * 8)
    with pytest.raises(InputError, match=r"9 tokens, more than max_num_batched_tokens \(8\)"):
        processor(chunked=False).process("r", prompt_token_ids=[1] * 9)


def test_lora_adapters_must_be_known() -> None:
    with pytest.raises(InputError, match="LoRA is off"):
        processor().process("r", prompt_token_ids=[1], lora_name="pong")
    with pytest.raises(InputError, match="no LoRA adapter named 'ping'"):
        processor(loras=("pong",)).process("r", prompt_token_ids=[1], lora_name="ping")


def test_the_grammar_is_compiled_before_the_engine_sees_the_request() -> None:
    grammars = Grammars()
    spec = StructuredOutputs(regex="[ab]+")
    processor(grammars=grammars).process("r", prompt_token_ids=[1], params=SamplingParams(structured_outputs=spec))
    assert grammars.compiled == [spec]
    with pytest.raises(InputError, match="cannot be enforced") as info:
        processor().process("r", prompt_token_ids=[1], params=SamplingParams(structured_outputs=StructuredOutputs(regex="(")))
    assert info.value.param == "structured_outputs"
