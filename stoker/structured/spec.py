"""What a request constrains its output to. [no torch]

Exactly one of: `json` (a JSON schema, as text), `json_object` (any JSON object), `regex`,
`choice` (one of these strings), `grammar` (EBNF, xgrammar's dialect of GBNF). The names are
vLLM's `structured_outputs` fields; OpenAI's `response_format` maps onto `json` /
`json_object`. `key` identifies the compiled grammar (compiled once per key, then cached).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None] + (
            ["json_object"] if self.json_object else [])
        if len(set_) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; got {set_ or 'none'}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) if not self.json_object else "json_object"

    @property
    def key(self) -> tuple[str, str]:
        value = {"json": self.json, "regex": self.regex, "grammar": self.grammar, "json_object": ""}.get(self.kind)
        return self.kind, value if value is not None else "\x00".join(self.choice or ())

    @classmethod
    def from_schema(cls, schema: dict) -> StructuredOutputs:
        return cls(json=json.dumps(schema))  # property order kept: the grammar generates in it
