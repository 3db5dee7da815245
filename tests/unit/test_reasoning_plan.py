"""What `--reasoning-parser` makes of one request (generate/reasoning_output.py): the prompt that
already closed the thinking, include_reasoning, the fields a server without a parser leaves out."""

from __future__ import annotations

from stoker.server.generate.reasoning_output import ReasoningPlan


def _streamed(plan: ReasoningPlan, chunks: list[str]) -> tuple[list[dict], str]:
    stream = plan.stream()
    pieces, content = [], ""
    for i, chunk in enumerate(chunks):
        piece, c = stream.step(chunk, i == len(chunks) - 1)
        pieces += [piece] if piece else []
        content += c
    return pieces, content


def test_no_parser_adds_nothing() -> None:
    plan = ReasoningPlan.of(None, True, "prompt")
    assert plan.split("<think>a</think>b") == (None, "<think>a</think>b")
    assert plan.fields(None) == {} and plan.end_marker is None and not plan.keeps_special_tokens
    assert _streamed(plan, ["<think>a", "</think>b"]) == ([], "<think>a</think>b")


def test_both_field_names_carry_the_reasoning() -> None:
    plan = ReasoningPlan.of("deepseek_r1", True, "<|assistant|>")
    reasoning, content = plan.split("<think>a</think>b")
    assert (reasoning, content) == ("a", "b")
    assert plan.fields(reasoning) == {"reasoning_content": "a", "reasoning": "a"}
    assert plan.end_marker == "</think>" and plan.keeps_special_tokens
    assert _streamed(plan, ["<think>a", "</think>b"]) == ([{"reasoning_content": "a", "reasoning": "a"}], "b")


def test_include_reasoning_false() -> None:
    plan = ReasoningPlan.of("deepseek_r1", False, "")
    assert plan.fields("a") == {"reasoning_content": None, "reasoning": None}
    assert _streamed(plan, ["<think>a", "</think>b"]) == ([], "b")


def test_a_prompt_that_closed_the_thinking_leaves_all_content() -> None:
    """Qwen3's template with enable_thinking false ends the prompt with an empty think block."""
    plan = ReasoningPlan.of("qwen3", True, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert plan.split("Hello</think>x") == (None, "Hello</think>x")
    assert plan.end_marker is None  # structured outputs from the first token
    assert plan.fields(None) == {"reasoning_content": None, "reasoning": None}
    assert _streamed(plan, ["Hel", "lo"]) == ([], "Hello")


def test_serve_flags() -> None:
    import pytest

    from stoker.cli import build_parser
    from stoker.server.state import ServerSettings

    args = build_parser().parse_args(["serve", "--reasoning-parser", "gpt_oss", "--tool-call-parser", "openai"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("gpt_oss", "openai")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "nope"])
    with pytest.raises(ValueError, match="qwen3"):
        ServerSettings(model_path="m", served_model_names=("m",), reasoning_parser="nope")
    ServerSettings(model_path="m", served_model_names=("m",), reasoning_parser="qwen3", tool_call_parser="openai")
