"""The core, config and planning modules must never import torch (DESIGN.md principle 1):
core/, roofline/ and fleet/ whole, and the plain-data modules the engine and server share."""

import subprocess
import sys
from pathlib import Path

import pytest

import stoker

PURE_FOLDERS = ["core", "roofline", "fleet"]
PURE_MODULES = [
    "stoker.config",
    "stoker.sampling_params",
    "stoker.outputs",
    "stoker.quantization.config",
    "stoker.engine.input_processor",
    "stoker.runner.info",
    "stoker.distributed.partition",
    "stoker.structured.spec",
    "stoker.server.generate.tools.parsers",
    "stoker.server.generate.tools.schema",
]


def folder_modules(folder: str) -> list[str]:
    root = Path(stoker.__file__).parent / folder
    return sorted(f"stoker.{folder}.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__")


def assert_torch_free(modules: list[str]) -> None:
    """Import each in one fresh interpreter; the first that pulls torch in is named."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "    assert 'torch' not in sys.modules, f'{m} imports torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("folder", PURE_FOLDERS)
def test_folder_imports_no_torch(folder: str) -> None:
    modules = folder_modules(folder)
    assert len(modules) >= 3, modules
    assert_torch_free(modules)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_imports_no_torch(module: str) -> None:
    assert_torch_free([module])
