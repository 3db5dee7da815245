"""The JSON schema that `tool_choice` "required" or a named function constrains the output to,
as vLLM builds it. [no torch]

* named: the function's `parameters` schema itself; the output is the arguments object.
* required: `[{"name": <one tool's name>, "parameters": <that tool's arguments>}, ...]`, at least
  one item, an `anyOf` over the tools (so each name comes with its own parameters). The tools'
  `$defs` / `definitions` are hoisted to the root, where their `#/$defs/...` references point.

A function without parameters takes `{}` (an object with no properties).
"""

from __future__ import annotations

import copy
from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEF_KEYS = ("$defs", "definitions")


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return copy.deepcopy(parameters) if parameters else dict(EMPTY_PARAMETERS, properties={})


def required_schema(functions: list[tuple[str, dict[str, Any] | None]], at_most_one: bool = False) -> dict[str, Any]:
    """functions: (name, parameters) per tool. ValueError when two tools define the same
    `$defs` name differently (one root cannot hold both)."""
    hoisted: dict[str, dict[str, Any]] = {key: {} for key in _DEF_KEYS}
    items = []
    for name, parameters in functions:
        params = parameters_schema(parameters)
        for key in _DEF_KEYS:
            for def_name, schema in (params.pop(key, None) or {}).items():
                if hoisted[key].setdefault(def_name, schema) != schema:
                    raise ValueError(f"tools define {key} {def_name!r} twice, differently; "
                                     "give the definitions distinct names")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if at_most_one:  # parallel_tool_calls: false, which the grammar can honour here
        schema["maxItems"] = 1
    for key in _DEF_KEYS:
        if hoisted[key]:
            schema[key] = hoisted[key]
    return schema
