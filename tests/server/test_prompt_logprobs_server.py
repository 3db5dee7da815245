"""Prompt log-probabilities through the server (issue 15, part 4): echo + logprobs, max_tokens 0,
vLLM's prompt_logprobs extra, and lm-evaluation-harness's own `local-completions` scoring a
test-made multiple-choice task against its `hf` model on the same checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from tests.model.helpers import hf_logits, load_hf
from tests.server.conftest import MODEL, LiveServer

PROMPT_IDS = [17, 250, 33, 401, 88, 512, 9, 777, 64, 300]


@pytest.fixture(scope="module")
def hf_ref(tiny_llama) -> torch.Tensor:
    """(len, vocab) log-softmax of HF transformers over PROMPT_IDS: row p scores token p + 1."""
    return torch.log_softmax(hf_logits(load_hf(tiny_llama), PROMPT_IDS), -1)


def test_echo_with_logprobs_scores_the_prompt(client: OpenAI, hf_ref: torch.Tensor) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=2, temperature=0, logprobs=2, echo=True)
    lp = out.choices[0].logprobs
    n = len(PROMPT_IDS)
    assert len(lp.token_logprobs) == n + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, n):
        assert lp.token_logprobs[p] == pytest.approx(hf_ref[p - 1, PROMPT_IDS[p]].item(), abs=1e-4)
        assert max(lp.top_logprobs[p].values()) == pytest.approx(hf_ref[p - 1].max().item(), abs=1e-4)
    assert all(v is not None for v in lp.token_logprobs[n:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert out.usage.completion_tokens == 2


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(client: OpenAI, hf_ref: torch.Tensor) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice = out.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(PROMPT_IDS)
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(hf_ref[-2, PROMPT_IDS[-1]].item(), abs=1e-4)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    detok = httpx.post(str(client.base_url).removesuffix("/v1/") + "/detokenize", json={"tokens": PROMPT_IDS}).json()
    assert choice.text == detok["prompt"]
    text = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=0, echo=True)
    assert text.choices[0].text == "The quick brown fox"


def test_max_tokens_zero_without_echo_is_refused(live_server: LiveServer) -> None:
    resp = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_carries_the_prompt_logprobs_first(client: OpenAI, hf_ref: torch.Tensor) -> None:
    stream = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, temperature=0, logprobs=1,
                                       echo=True, stream=True)
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[len(PROMPT_IDS) - 1] == pytest.approx(hf_ref[-2, PROMPT_IDS[-1]].item(), abs=1e-4)
    whole = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_vllm_prompt_logprobs_extra(live_server: LiveServer, hf_ref: torch.Tensor) -> None:
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 2}
    resp = httpx.post(live_server.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT_IDS)
    entry = plp[3][str(PROMPT_IDS[3])]
    assert entry["logprob"] == pytest.approx(hf_ref[2, PROMPT_IDS[3]].item(), abs=1e-4)
    assert entry["rank"] == int((hf_ref[2] > hf_ref[2, PROMPT_IDS[3]]).sum()) + 1
    too_many = httpx.post(live_server.url + "/v1/completions", json={**body, "prompt_logprobs": 10_000}, timeout=30)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


_TASK = """task: stoker_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _loglikelihoods(results: dict) -> list[float]:
    return [resp[0][0] for sample in results["samples"]["stoker_tiny_mc"] for resp in sample["resps"]]


def test_lm_eval_local_completions_matches_its_hf_model(live_server: LiveServer, tiny_llama: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """lm-eval's loglikelihood requests (echo, logprobs 1, max_tokens 1 on token ids) score a
    multiple-choice task; its `hf` model scores the same task with transformers: equal to 1e-3."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [
        {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
        {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
        {"question": "A cat says", "choices": [" meow", " woof", " moo", " nothing at all"], "answer": 0},
    ]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "stoker_tiny_mc.yaml").write_text(_TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path))

    def run(model: str, model_args: dict) -> list[float]:
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["stoker_tiny_mc"], task_manager=tasks,
                                      log_samples=True, batch_size=1)
        return _loglikelihoods(out)

    # lm-eval's defaults: it finds /tokenizer_info and /tokenize and tokenizes through the server
    # (its "remote" backend), without BOS; its hf model is told to leave BOS out too.
    with caplog.at_level(logging.INFO, logger="lm_eval"):
        served = run("local-completions", {"base_url": live_server.url + "/v1/completions", "model": MODEL,
                                           "num_concurrent": 1, "max_retries": 1})
    assert "remote tokenizer" in caplog.text.lower()
    reference = run("hf", {"pretrained": str(tiny_llama), "dtype": "float32", "device": "cpu", "add_bos_token": False})
    assert len(served) == sum(len(d["choices"]) for d in docs)
    assert served == pytest.approx(reference, abs=1e-3)


def test_chat_prompt_logprobs(live_server: LiveServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1, "prompt_logprobs": 1}
    resp = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    plp = resp.json()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == resp.json()["usage"]["prompt_tokens"]
    assert all(e and all(v["logprob"] <= 0 for v in e.values()) for e in plp[1:])
    streamed = httpx.post(live_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
