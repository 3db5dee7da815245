"""Training rows from JSONL, checked line by line before any model is loaded. [no torch]

Two row shapes, the ones trl and the OpenAI fine-tuning API read:
  chat:               {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
  prompt/completion:  {"prompt": "...", "completion": "..."}  (plain text, as /v1/completions sees it)
                      {"prompt": [messages], "completion": [messages]}  (conversational: becomes chat)
A file may mix them. A bad row is an error that names its file and line, because a silently
skipped row is a dataset the user did not mean to train on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
_SHAPES = '{"messages": [...]} or {"prompt": ..., "completion": ...}'


class DataError(ValueError):
    """A training file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class ChatRow:
    line: int
    messages: list[dict[str, Any]]
    # Assistant messages before this index are context, not targets: a conversational
    # prompt/completion row trains only on its completion's messages.
    train_from: int = 0


@dataclass(frozen=True)
class CompletionRow:
    line: int
    prompt: str
    completion: str


Row = ChatRow | CompletionRow


def read_rows(path: str | Path) -> list[Row]:
    """Every row of a JSONL file; DataError naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    rows: list[Row] = []
    with path.open(encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue  # blank lines (a trailing newline, an editor's) carry no row
            rows.append(parse_row(text, line_no, where=f"{path}:{line_no}"))
    if not rows:
        raise DataError(f"{path}: no rows (expected one JSON object per line: {_SHAPES})")
    return rows


def parse_row(text: str, line_no: int, where: str) -> Row:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (a JSON array? JSONL holds one object per line)" if text.lstrip().startswith("[") else ""
        raise DataError(f"{where}: not a JSON object: {exc.msg}{hint}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object ({_SHAPES}), got {type(obj).__name__}")
    if "messages" in obj:
        messages = _messages(obj["messages"], where, "messages")
        _need_assistant(messages, where, "messages")
        return ChatRow(line_no, messages)
    if "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise DataError(f"{where}: completion is empty: nothing to learn from")
            return CompletionRow(line_no, prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt_msgs = _messages(prompt, where, "prompt")
            completion_msgs = _messages(completion, where, "completion")
            _need_assistant(completion_msgs, where, "completion")
            return ChatRow(line_no, prompt_msgs + completion_msgs, train_from=len(prompt_msgs))
        raise DataError(f"{where}: prompt and completion must both be strings or both be message lists, got "
                        f"{type(prompt).__name__} and {type(completion).__name__}")
    raise DataError(f"{where}: expected {_SHAPES}, got keys {sorted(obj)}")


def _messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key} must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {key}[{i}] is not an object")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: {key}[{i}].role is {m.get('role')!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key}[{i}].content must be a string")
    return value


def _need_assistant(messages: list[dict[str, Any]], where: str, key: str) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: {key} has no assistant message: nothing to learn from")


def split_rows(rows: list[Row], fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, eval): a seeded shuffle so `--resume` sees the same split; at least one row each."""
    import random

    if fraction <= 0:
        return rows, []
    if len(rows) < 2:
        raise DataError(f"--eval-split needs at least 2 rows, the data has {len(rows)}; pass --eval-split 0 "
                        "or --eval-data FILE")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    num_eval = min(len(rows) - 1, max(1, round(len(rows) * fraction)))
    held = set(order[:num_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]
