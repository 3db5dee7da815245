"""The core, config and planning modules must never import torch (DESIGN.md principle 1)."""

import subprocess
import sys

import pytest

PURE_MODULES = [
    "stoker.config",
    "stoker.sampling_params",
    "stoker.outputs",
    "stoker.core.sequence",
    "stoker.core.block_manager",
    "stoker.core.scheduler",
    "stoker.quantization.config",
    "stoker.core.step",
    "stoker.engine.input_processor",
    "stoker.distributed.partition",
    "stoker.structured.spec",
    "stoker.server.generate.tools.parsers",
    "stoker.server.generate.tools.schema",
    "stoker.roofline.live",
    "stoker.roofline.microfit",
    "stoker.roofline.device_file",
    "stoker.roofline.profiles",
    "stoker.roofline.kvcapacity",
    "stoker.roofline.lora",
    "stoker.roofline.report",
]


@pytest.mark.parametrize("module", PURE_MODULES)
def test_module_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    subprocess.run([sys.executable, "-c", code], check=True)
