"""`stoker serve --speculative-config '{"method": "draft_model", ...}'` as a process, driven by the
official openai client: the same greedy text as the offline engine without drafts, and the
vllm:spec_decode_* counters showing every draft of a model drafting for itself accepted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from stoker import LLM, SamplingParams
from tests.server.conftest import start_serve_process, stop_process

PROMPT = [5, 6, 7, 8, 9, 10, 11] * 6


def test_serve_with_a_draft_model(tiny_llama: Path, tmp_path: Path) -> None:
    from openai import OpenAI

    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    proc, url = start_serve_process([str(tiny_llama), "--max-model-len", "256", "--served-model-name", "tiny",
                                     "--kv-cache-memory-bytes", str(8 << 20), "--max-num-seqs", "8",
                                     "--speculative-config", json.dumps(spec)], tmp_path / "server.log")
    try:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        stop_process(proc)
    base = LLM(str(tiny_llama), max_model_len=256, kv_cache_memory_bytes=4 << 20)
    want = base.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text
    assert got.choices[0].text == want
    counts = {name: float(v) for name, v in re.findall(r'^(vllm:spec_decode_num_\w+)_total\{[^}]*\} (\S+)$', metrics, re.M)}
    assert counts["vllm:spec_decode_num_draft_tokens"] > 0
    assert counts["vllm:spec_decode_num_accepted_tokens"] == counts["vllm:spec_decode_num_draft_tokens"]
    assert "draft model" in (tmp_path / "server.log").read_text()
