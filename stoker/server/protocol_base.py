"""The request-body base types every API's bodies share (generation, pooling, responses).

Strict numbers: a JSON number, never a boolean or a numeric string. Unknown fields are
accepted and ignored, as vLLM and OpenAI do. NaN and infinity are refused: they pass every
`<`/`>` range check and would poison the sampler. A whole request body is checked first for
text that is not valid Unicode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from pydantic_core import PydanticCustomError

_INT64 = dict(ge=-(2**63), le=2**63 - 1)
TokenId = Annotated[int, Strict(), Field(**_INT64)]
SmallInt = Annotated[int, Strict(), Field(ge=-(2**31), le=2**31 - 1)]
Number = Annotated[float, Strict()]


def _lone_surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string in `value` that is not valid Unicode, or None.

    JSON's \\ud800 escapes decode to Python strings with lone surrogates, which no tokenizer,
    encoder or log line can take: they are refused at the door instead of failing deep inside."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            name = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else str(key)
            where = f"{path}.{name}" if path else name
            found = _lone_surrogate_at(key, where) or _lone_surrogate_at(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_at(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


Unhonoured = tuple[tuple[str, Callable[[Any], bool], str], ...]  # (field, does this value ask, why refused)


def unsupported_field(name: str, why: str) -> PydanticCustomError:
    """The 400 for a field this server cannot honour; `param` is the top-level field's name."""
    return PydanticCustomError("unsupported_field", "{name}: {why}", {"name": name, "why": why, "param": name.split("[")[0]})


def refuse_unhonoured(data: Any, table: Unhonoured) -> Any:
    """A request body's first field whose value asks for what the server does not do, refused by name."""
    if isinstance(data, dict):
        for name, asks, why in table:
            if name in data and asks(data[name]):
                raise unsupported_field(name, why)
    return data


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class _Request(_Body):
    """A whole request body: checked once, before its parts, for text that is not Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate_at(data, "")
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode", "{where} is not valid Unicode (a lone UTF-16 surrogate such as \\ud800); send UTF-8 text",
                {"where": where, "param": where.split(".")[0]},
            )
        return data
