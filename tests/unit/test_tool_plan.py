"""What `auto` makes of parsed calls in an answer (tools/calls.py): `parallel_tool_calls: false`
keeps only the first call, whole and streamed (as vLLM filters them), and a call keeps the id the
model wrote, else gets one of its parser's kind."""

from __future__ import annotations

from typing import Any

from stoker.server.generate.tools.calls import ToolPlan
from stoker.server.generate.tools.parsers import get_parser

KIMI = ("Two calls.<|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|>"
        "<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
HERMES = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'


def _streamed(plan: ToolPlan, text: str) -> tuple[str, list[dict[str, Any]]]:
    stream, content, opened = plan.stream(), "", []
    for k, ch in enumerate(text):
        for piece in stream.step(ch, k == len(text) - 1):
            content += piece.get("content") or ""
            opened += [tc for tc in piece.get("tool_calls", []) if "id" in tc]
    return content, opened


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    for parallel, names in ((True, ["f", "g"]), (False, ["f"])):
        plan = ToolPlan("auto", parser=get_parser("kimi_k2", {}), parallel=parallel)
        message, reason = plan.message(KIMI, "stop")
        assert reason == "tool_calls" and message["content"] == "Two calls."
        assert [c["function"]["name"] for c in message["tool_calls"]] == names
        content, opened = _streamed(plan, KIMI)
        assert content == "Two calls." and [c["function"]["name"] for c in opened] == names
        assert [c["index"] for c in opened] == list(range(len(names)))


def test_call_ids_come_from_the_model_or_the_parser() -> None:
    kimi = ToolPlan("auto", parser=get_parser("kimi_k2", {})).message(KIMI, "stop")[0]
    assert [c["id"] for c in kimi["tool_calls"]] == ["functions.f:0", "functions.g:1"]
    mistral = ToolPlan("auto", parser=get_parser("mistral", {})).message('[TOOL_CALLS]f[ARGS]{"a": 1}', "stop")[0]
    (call,) = mistral["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    hermes = ToolPlan("auto", parser=get_parser("hermes", {}), parallel=False).message(HERMES, "stop")[0]
    assert [c["id"][:14] for c in hermes["tool_calls"]] == ["chatcmpl-tool-"]
