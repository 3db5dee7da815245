"""`stoker serve --speculative-config` as a client sees it: the same greedy text as the server
without drafts, vLLM's vllm:spec_decode_* counters moving, the periodic SpecDecoding line, and
what the engine cannot verify refused with a 400 naming the field."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.server.conftest import MODEL, LiveServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
PROMPT = [5, 6, 7, 8, 9, 10, 11] * 6


def _complete(live: LiveServer, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                            **body})


def test_spec_decode_server_is_lossless_counts_and_refuses(server_factory: Callable[..., LiveServer],
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

    bad = _complete(spec, response_format={"type": "json_object"}, ignore_eos=False)
    assert bad.status_code == 400 and "speculative" in bad.text and "response_format" in bad.text, bad.text
    spec.wait_idle()
    engine = spec.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.check_integrity()
