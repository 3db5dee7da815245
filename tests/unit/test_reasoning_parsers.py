"""Reasoning parsers (issue 32, part 3): what each splits out of a whole text, and that streaming
the same text split at every point (and one character at a time) gives the same split."""

from __future__ import annotations

import pytest

from stoker.server.generate.reasoning import PARSERS, get_reasoning_parser

R1, QWEN3, GRANITE, GPT_OSS = (PARSERS[n] for n in ("deepseek_r1", "qwen3", "granite", "gpt_oss"))

CASES = [
    # (parser, text, reasoning, content)
    (R1, "<think>abc</think>hello", "abc", "hello"),
    (R1, "abc</think>hello", "abc", "hello"),  # <think> was in the prompt
    (R1, "\n<think>\nabc\n</think>\n\nhello", "\nabc\n", "\n\nhello"),
    (R1, "still thinking", "still thinking", None),  # cut off while thinking: all reasoning
    (R1, "<think>cut at </thi", "cut at </thi", None),
    (R1, "<think>x</think>", "x", None),
    (R1, "<think></think>answer", None, "answer"),
    (R1, "a</think>b</think>c", "a", "b</think>c"),  # the first </think> ends the reasoning
    (R1, "<thi", "<thi", None),
    (R1, "", None, None),
    (QWEN3, "<think>abc</think>hello", "abc", "hello"),
    (QWEN3, "abc</think>hello", "abc", "hello"),
    (QWEN3, "no thinking here", None, "no thinking here"),  # enable_thinking false
    (QWEN3, "<think>never closed", None, "<think>never closed"),
    (QWEN3, "\n\n</think>\n\nok", "\n\n", "\n\nok"),
    (QWEN3, "", None, None),
    (GRANITE, "Here is my thought process:\nA.\nHere is my response:\nB.", "\nA.\n", "\nB."),
    (GRANITE, "Here's my thought process: x Here's my response: y", " x ", " y"),
    (GRANITE, "  Here is my thought process:t\nHere is my response:", "t\n", None),
    (GRANITE, "Plain answer.", None, "Plain answer."),
    (GRANITE, "Here is my thought process: never answered", None, "Here is my thought process: never answered"),
    (GRANITE, "Here is my", None, "Here is my"),
    (GRANITE, "Here is my response: r", None, "Here is my response: r"),
    (GPT_OSS, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
     "Think.", "Hi!"),
    (GPT_OSS, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     "Think.", "Hi!"),  # <|return|> is a stop token: not in the text
    (GPT_OSS, "<|channel|>analysis<|message|>half a tho", "half a tho", None),
    (GPT_OSS, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
              "<|start|>assistant<|channel|>final<|message|>c", "ab", "c"),
    (GPT_OSS, "<|channel|>final<|message|>just <|an answer", None, "just <|an answer"),
    (GPT_OSS, "<|channel|>analysis<|message|>t<|end|><|start|>assistant<|channel|>commentary to=functions.f "
              "<|constrain|>json<|message|>{\"a\": 1}<|call|>", "t",
     "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}<|call|>"),
    (GPT_OSS, "<|channel|>analysis<|message|>t<|end|><|start|>assistant<|chan", "t", None),  # header cut off
    (GPT_OSS, "plain text, no harmony", None, "plain text, no harmony"),
    (GPT_OSS, "<|channel|>analysis to=functions.f<|message|>{}<|call|>", None,
     "<|channel|>analysis to=functions.f<|message|>{}<|call|>"),  # a call from analysis is still a call
    (GPT_OSS, "", None, None),
]


def _streamed(parser, chunks: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning = content = ""
    for i, chunk in enumerate(chunks):
        r, c = stream.feed(chunk, final=i == len(chunks) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def _splits(text: str) -> list[list[str]]:
    """The text whole, cut once at every point, cut twice at every pair, and one character at a time."""
    n = len(text)
    out = [[text], list(text) or [""], [text, ""]]
    out += [[text[:i], text[i:]] for i in range(n + 1)]
    out += [[text[:i], text[i:j], text[j:]] for i in range(n + 1) for j in range(i, n + 1) if n <= 60]
    return out


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_whole_text(parser, text: str, reasoning: str | None, content: str | None) -> None:
    assert parser.extract(text) == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_streamed_at_every_split_equals_whole(parser, text: str, reasoning: str | None, content: str | None) -> None:
    for chunks in _splits(text):
        assert _streamed(parser, chunks) == (reasoning or "", content or ""), chunks


def test_r1_streams_reasoning_before_the_end_tag() -> None:
    stream = R1.stream()
    assert stream.feed("<think>Let me") == ("Let me", "")
    assert stream.feed(" see.</th") == (" see.", "")  # `</th` held: it may begin </think>
    assert stream.feed("ink>Yes") == ("", "Yes")
    assert stream.feed(" indeed", final=True) == ("", " indeed")


def test_qwen3_holds_until_decided() -> None:
    stream = QWEN3.stream()
    assert stream.feed("<think>Let me see") == ("", "")
    assert stream.feed("</think>Yes") == ("Let me see", "Yes")
    assert stream.feed("!") == ("", "!")


def test_granite_plain_answer_streams_at_once() -> None:
    stream = GRANITE.stream()
    assert stream.feed("Her") == ("", "")  # may open with the thought phrase
    assert stream.feed("e we go") == ("", "Here we go")


def test_gpt_oss_streams_analysis_as_it_comes() -> None:
    stream = GPT_OSS.stream()
    assert stream.feed("<|channel|>analy") == ("", "")
    assert stream.feed("sis<|message|>I think<|e") == ("I think", "")
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>Yes") == ("", "Yes")


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


def test_end_markers() -> None:
    assert R1.end_marker == QWEN3.end_marker == "</think>"
    assert GRANITE.end_marker == "Here is my response:"
    assert GPT_OSS.end_marker == "<|channel|>final<|message|>"


# Random texts built from the markers, their pieces and plain letters: every parser's stream must
# agree with its whole-text split whatever the text and however it is cut.
_ATOMS = ["<think>", "</think>", "</th", "<th", "a", "b ", "\n", " ", "Here is my thought process:",
          "Here's my response:", "Here is my", "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
          "<|message|>", "<|end|>", "<|start|>", "assistant", "<|call|>", "<|", "|>", "{}", '{"a": 1}']


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_random_texts_stream_as_whole(name: str) -> None:
    import random

    parser, rng = PARSERS[name], random.Random(name)
    for _ in range(400):
        text = "".join(rng.choice(_ATOMS) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        reasoning, content = parser.extract(text)
        assert _streamed(parser, chunks) == (reasoning or "", content or ""), (text, chunks)
