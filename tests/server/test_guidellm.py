"""guidellm (a standard serving benchmark, run as its users run it) completes against the server.

guidellm streams with vLLM's `stream_options: {"include_usage": true, "continuous_usage_stats":
true}` and reads usage from every chunk; before the server answered that field every request
of a run failed. The run here is small (synchronous, a few requests) and must end with no error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import MODEL, LiveServer

GUIDELLM = shutil.which("guidellm") or str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "guidellm")


@pytest.mark.skipif(not Path(GUIDELLM).exists(), reason="guidellm is not installed (make install adds it)")
def test_guidellm_run_completes_with_no_errors(live_server: LiveServer, tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "guidellm.json"
    cmd = [GUIDELLM, "run",
           "--backend", f"kind=openai_http,target={live_server.url},model={MODEL}",
           "--profile", "kind=synchronous",
           "--constraint", "kind=max_requests,count=6",
           "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=6",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_llama}",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == 0 and made["incomplete"] == 0 and made["successful"] >= 6, made
    # guidellm counted the output tokens from the usage it read in the stream
    assert bench["metrics"]["output_token_count"]["successful"]["total_sum"] == 6 * made["successful"]
