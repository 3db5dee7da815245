"""Who may import whom (DESIGN.md, seams 19, 23, 25): read from the sources, no import runs."""

from __future__ import annotations

import ast
from pathlib import Path

import stoker

ROOT = Path(stoker.__file__).parent


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (absolute names; `from a import b` gives a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


# `stoker serve --headless` runs a node's tensor-parallel ranks and no server: the CLI starts them.
ALLOWED = {"server/cli.py": {"stoker.executor.headless", "stoker.executor.headless.run_node"}}


def test_the_server_never_reaches_behind_the_async_engine() -> None:
    offenders = {}
    for path in sorted((ROOT / "server").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        bad = {m for m in imports_of(path) if m.startswith(("stoker.engine.llm_engine", "stoker.executor", "stoker.runner"))}
        bad -= ALLOWED.get(name, set())
        text = path.read_text()
        for attr in ("engine.engine", "._engine", ".driver_runner", "executor.collective", "executor.release"):
            if attr in text:
                bad.add(attr)
        if bad:
            offenders[name] = sorted(bad)
    assert not offenders, offenders


def test_the_engine_asks_the_executor_and_never_its_runner() -> None:
    for path in sorted((ROOT / "engine").rglob("*.py")):
        text = path.read_text()
        assert "driver_runner" not in text and "runner.matchers" not in text, path
        assert not {m for m in imports_of(path) if m.startswith("stoker.runner")}, path
