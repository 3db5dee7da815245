"""Who may import whom (DESIGN.md, seams 19, 23, 25): read from the sources, no import runs.

Every folder sits on one floor; a module imports its own floor and those below, lazy imports
(inside functions) included, `if TYPE_CHECKING:` imports not (they never run). No two modules
import each other, even lazily.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import stoker

ROOT = Path(stoker.__file__).parent

# Bottom (0) to top. Pure data and planning at the bottom; kernels; the collectives, quantization
# formats and LoRA adapter files the layers use; the layers and their weight methods; models and
# sampling; the runner; the process machinery that runs runners; the engines; the tools and the
# server that drive them; the CLI. `stoker/__init__` exports `LLM` lazily from the top.
FLOORS = {
    "config": 0, "sampling_params": 0, "outputs": 0, "paths": 0, "core": 0, "roofline": 0, "fleet": 0, "structured": 0, "kv_transfer": 0,
    "kernels": 1, "cpu_runtime": 1,
    "distributed": 2, "quantization": 2, "lora": 2,
    "layers": 3,
    "models": 4, "sampling": 4,
    "runner": 5, "spec_decode": 5,
    "executor": 6,
    "engine": 7, "pooling": 7,
    "testing": 8,
    "server": 9, "router": 9, "bench": 9, "doctor": 9, "telemetry": 9, "finetune": 9,
    "cli": 10, "__main__": 10, "__init__": 10,
}


def imports_of(path: Path, runs_only: bool = False) -> set[str]:
    """Every module a file imports (absolute names; `from a import b` gives a and a.b);
    runs_only: without those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test)
            for n in ast.walk(block)} if runs_only else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@functools.cache
def module_graph() -> dict[str, set[str]]:
    """stoker module -> the stoker modules it imports (when they run)."""
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        targets = {module_of(m) for m in imports_of(path, runs_only=True) if m.startswith("stoker.")}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def floor_of(module: str) -> int:
    parts = module.split(".")
    return FLOORS[parts[1] if len(parts) > 1 else "__init__"]


def test_every_folder_has_a_floor() -> None:
    assert not {m.split(".")[1] for m in module_graph() if "." in m} - set(FLOORS)


def test_no_import_runs_back_up() -> None:
    up = sorted(f"{a} -> {b}" for a, bs in module_graph().items() for b in bs if floor_of(a) < floor_of(b))
    assert not up, up


def test_no_two_modules_import_each_other() -> None:
    graph = module_graph()
    circles: list[list[str]] = []
    seen: set[str] = set()
    for start in sorted(graph):  # a path from start back to start, depth first
        stack, path_of = [start], {start: [start]}
        while stack:
            node = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    circles.append(path_of[node] + [start])
                elif nxt not in path_of and nxt not in seen:
                    path_of[nxt] = path_of[node] + [nxt]
                    stack.append(nxt)
        seen.add(start)
    assert not circles, circles[:3]


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
