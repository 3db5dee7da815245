"""What a request constrains its output to. [no torch]

Exactly one of: `json` (a JSON schema, as text), `json_object` (any JSON object), `regex`,
`choice` (one of these strings), `grammar` (EBNF, xgrammar's dialect of GBNF). The names are
vLLM's `structured_outputs` fields; OpenAI's `response_format` maps onto `json` /
`json_object`. `key` identifies the compiled grammar (compiled once per key, then cached).

`enforce_after`: token ids (a reasoning model's end-of-thinking marker) that must appear in the
output before the grammar applies; the thinking before them is free, the rest follows the
grammar from the token after them on (vLLM's structured outputs with a reasoning parser).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


# Keywords xgrammar's JSON-schema converter accepts but does not enforce (measured: a value
# violating them is accepted token by token): refused, never a silent pass.
UNENFORCED_KEYWORDS = frozenset({
    "not", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas", "if", "then", "else",
    "propertyNames", "patternProperties", "unevaluatedProperties", "unevaluatedItems",
})
_NAME_MAPS = ("properties", "$defs", "definitions")  # their keys are names, their values schemas
_DATA = ("enum", "const", "default", "examples", "required", "title", "description")  # values, not schemas


def _unenforced_keyword(node: object, path: str) -> str | None:
    """The path of the first keyword in the schema that cannot be enforced, or None."""
    if isinstance(node, list):
        return next((w for i, item in enumerate(node) if (w := _unenforced_keyword(item, f"{path}[{i}]"))), None)
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        if key in _DATA:
            continue
        if key in UNENFORCED_KEYWORDS or (key == "uniqueItems" and value is True):
            return f"{path}.{key}"
        if key in _NAME_MAPS and isinstance(value, dict):
            found = next((w for name, sub in value.items() if (w := _unenforced_keyword(sub, f"{path}.{key}.{name}"))), None)
        else:
            found = _unenforced_keyword(value, f"{path}.{key}")
        if found:
            return found
    return None


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    enforce_after: tuple[int, ...] = ()  # not part of `key`: the same grammar, gated

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
            where = _unenforced_keyword(schema, "schema")
            if where is not None:
                raise ValueError(f"JSON-schema keyword {where} cannot be enforced while generating; remove it")
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
