"""Argument values written as text (qwen3_coder's `<parameter=...>`, glm45's `<arg_value>`),
typed by the request's tool schemas, as vLLM types them. [no torch]

The value of a parameter the schema declares as
* a string (or not declared at all: nothing says otherwise) stays the text, as written;
* an integer / number / boolean becomes one when the text reads as one (`True` / `False` too:
  templates render Python values with `| string`); otherwise it stays the text;
* an object / array becomes the JSON (or Python literal, parsed safely) it spells;
* null (or nullable, and the text is `null` / `None`) becomes null.
A value that cannot be read as its declared type stays the text: the client sees what the
model wrote instead of a guess.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from stoker.server.generate.tools.parsers.base import JSON_ERRORS, ToolSchemas, is_jsonable

# Type names taken as "string" (vLLM reads these spellings too: schemas written by hand vary)
_STRING_KINDS = ("string", "str", "text", "enum", "char", "varchar")


def parameter_schema(tools: ToolSchemas, function: str, parameter: str) -> dict[str, Any] | None:
    """The schema of `function`'s `parameter` in the request's tools, or None if not declared."""
    params = tools.get(function) or {}
    props = params.get("properties") if isinstance(params, dict) else None
    schema = props.get(parameter) if isinstance(props, dict) else None
    return schema if isinstance(schema, dict) else None


def declared_type(schema: dict[str, Any] | None) -> tuple[str, bool]:
    """(the first non-null type the schema declares, "string" if none; whether null is allowed)."""
    if schema is None:
        return "string", False
    options: list[Any] = []
    if "type" in schema:
        options = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf") or schema.get("oneOf"), list):
        options = [o.get("type") for o in schema.get("anyOf") or schema.get("oneOf") if isinstance(o, dict)]
    elif "enum" in schema or "const" in schema:
        return "string", False
    elif "properties" in schema:
        return "object", False
    names = [str(o).strip().lower() for o in options if o is not None]
    nullable = "null" in names
    rest = [n for n in names if n != "null"]
    if rest:
        return rest[0], nullable
    return ("null" if nullable else "string"), nullable


def _literal(text: str) -> tuple[bool, Any]:
    """(True, value) when `text` is JSON or a Python literal of plain JSON data (never eval)."""
    try:
        value = json.loads(text)
    except JSON_ERRORS:
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return False, None
    if isinstance(value, tuple):
        value = list(value)
    return is_jsonable(value), value


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """qwen3_coder's rule: `text` as the type `schema` declares (the module docstring)."""
    kind, nullable = declared_type(schema)
    word = text.strip()
    if word.lower() in ("null", "none") and (nullable or kind not in _STRING_KINDS):
        return None
    if kind in _STRING_KINDS:
        return text
    if kind.startswith(("int", "uint", "long", "short")):
        try:
            return int(word)
        except ValueError:
            return text
    if kind.startswith(("num", "float", "double")):
        try:
            return int(word)
        except ValueError:
            pass
        try:
            number = float(word)
        except ValueError:
            return text
        return number if is_jsonable(number) else text
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(word.lower(), text)
    ok, value = _literal(text)
    if ok and (kind not in ("object", "array", "dict", "list") or isinstance(value, (dict, list))):
        return value
    return text


def json_or_text(text: str, schema: dict[str, Any] | None) -> Any:
    """glm45's rule (vLLM's): a parameter declared as a string stays the text; any other value
    that reads as JSON becomes that JSON value; the rest stays the text."""
    if schema is not None and declared_type(schema)[0] in _STRING_KINDS:
        return text
    try:
        value = json.loads(text)
    except JSON_ERRORS:
        return text
    return value if is_jsonable(value) else text
