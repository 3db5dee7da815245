"""`stoker serve --speculative-config` as a client sees it: the same greedy text as the server
without drafts, vLLM's vllm:spec_decode_* counters moving, the periodic SpecDecoding line, and
structured outputs (`response_format`) valid and equal to the server without drafts."""

from __future__ import annotations

from collections.abc import Callable

import json

import httpx
import jsonschema

from tests.model.helpers import STRUCTURED_SCHEMA
from tests.server.conftest import MODEL, LiveServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
PROMPT = [5, 6, 7, 8, 9, 10, 11] * 6


def _complete(live: LiveServer, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                            **body})


def test_spec_decode_server_is_lossless_counts_and_keeps_grammars(server_factory: Callable[..., LiveServer],
                                                           live_server: LiveServer) -> None:
    from stoker.server.observe.metrics import EngineLogLine

    spec = server_factory({"speculative_config": NGRAM})
    line = EngineLogLine()
    assert line.line(spec.state.engine) is None  # the baseline
    want = _complete(live_server)
    got = _complete(spec)
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    spec.wait_idle()
    m = spec.metrics()
    drafts = m['vllm:spec_decode_num_drafts_total{model_name="tiny-llama"}']
    drafted = m['vllm:spec_decode_num_draft_tokens_total{model_name="tiny-llama"}']
    accepted = m['vllm:spec_decode_num_accepted_tokens_total{model_name="tiny-llama"}']
    per_pos = [m[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny-llama",position="{i}"}}']
               for i in range(3)]
    assert 0 < drafts and 0 < accepted <= drafted <= 3 * drafts and sum(per_pos) == accepted
    text = line.line(spec.state.engine)
    assert text is not None and "SpecDecoding metrics: Mean acceptance length" in text, text
    assert not any(k.startswith("vllm:spec_decode") for k in live_server.metrics())  # off: not exported

    # response_format with drafts: the prompt repeats schema-valid JSON, so the n-gram drafts fire
    structured = {"prompt": '{"name": "bob", "age": 41} ' * 4, "ignore_eos": False, "max_tokens": 24,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": STRUCTURED_SCHEMA}}}
    want, got = _complete(live_server, **structured), _complete(spec, **structured)
    assert got.status_code == want.status_code == 200, got.text
    text = got.json()["choices"][0]["text"]
    assert text == want.json()["choices"][0]["text"] and got.json()["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), STRUCTURED_SCHEMA)
    spec.wait_idle()
    assert spec.metrics()['vllm:spec_decode_num_drafts_total{model_name="tiny-llama"}'] > drafts
    engine = spec.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.check_integrity()
