"""What `--reasoning-parser` makes of one chat request's output (vLLM's answer shape). [no torch]

The reasoning goes out as `message.reasoning_content` and `message.reasoning` (vLLM's older and
newer names, the same text), streamed as `delta.reasoning_content` / `delta.reasoning`; the
content after it goes on to the tool-call plan (calls.py), so tools are parsed in the answer,
never inside the thinking. `include_reasoning: false` drops the reasoning. A server without a
reasoning parser adds none of these fields.

When the rendered prompt already closed the thinking (a Qwen3 template called with
`enable_thinking: false` ends the prompt with `<think>\\n\\n</think>`), the model answers
directly: all of its text is content, and structured outputs apply from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.server.generate.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser


@dataclass(frozen=True)
class ReasoningPlan:
    parser: ReasoningParser | None  # None: the server has no reasoning parser
    include: bool = True
    prompt_ended: bool = False  # the prompt closed the thinking: all of the output is content

    @classmethod
    def of(cls, parser_name: str | None, include: bool, prompt_text: str) -> ReasoningPlan:
        if parser_name is None:
            return cls(None)
        parser = get_reasoning_parser(parser_name)
        tail = prompt_text[-4 * len(parser.end_marker) - 64:]  # no copy of a long prompt
        return cls(parser, include, tail.rstrip().endswith(parser.end_marker))

    @property
    def active(self) -> bool:
        """True when the output is split (a parser, and the prompt left the thinking open)."""
        return self.parser is not None and not self.prompt_ended

    @property
    def keeps_special_tokens(self) -> bool:
        return self.active and bool(self.parser and self.parser.keeps_special_tokens)

    @property
    def end_marker(self) -> str | None:
        """The text after which structured outputs apply; None: from the first token."""
        return self.parser.end_marker if self.active and self.parser else None

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        if not self.active or self.parser is None:
            return None, text
        return self.parser.extract(text)

    def fields(self, reasoning: str | None) -> dict[str, Any]:
        """The message's reasoning fields (none without a parser; null when dropped or absent)."""
        if self.parser is None:
            return {}
        shown = reasoning if self.include else None
        return {"reasoning_content": shown, "reasoning": shown}

    def stream(self) -> ChoiceReasoningStream:
        return ChoiceReasoningStream(self)


class ChoiceReasoningStream:
    """One choice's text deltas -> (reasoning delta fields or None, content delta)."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.plan = plan
        self.parsed: ReasoningStream | None = plan.parser.stream() if plan.active and plan.parser else None

    def step(self, delta: str, final: bool) -> tuple[dict[str, Any] | None, str]:
        if self.parsed is None:
            return None, delta
        reasoning, content = self.parsed.feed(delta, final)
        piece = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning and self.plan.include else None
        return piece, content
