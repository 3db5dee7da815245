"""The router's pure parts: prefix index, replica choice, request rewriting, metric parsing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stoker.router.policy import Pool
from stoker.router.prefix import PrefixIndex
from stoker.router.requests import prefill_leg, prompt_text, single_sequence
from stoker.router.upstream import Upstream, parse_load

A, B = "http://a:1", "http://b:1"


def _pool(policy: str = "cache_aware", **kw) -> Pool:
    return Pool([Upstream(A, "worker"), Upstream(B, "worker")], policy=policy, prefix_chunk_chars=8, **kw)


def test_prefix_index_matches_whole_chunks_of_the_shared_prefix():
    idx = PrefixIndex(chunk_chars=4)
    idx.insert("abcdefghij", A)
    assert idx.match("abcdefgXYZ", [A, B]) == {A: 4, B: 0}  # "abcd" shared, "efgX" differs
    assert idx.match("abcdefghijkl", [A]) == {A: 8}  # "ij" is a partial chunk: not indexed
    assert idx.match("Xbcdefgh", [A]) == {A: 0}  # a differing head breaks the chain
    idx.insert("abcdefgh", B)
    assert idx.match("abcdefgh", [A, B]) == {A: 8, B: 8}
    idx.forget(A)
    assert idx.match("abcdefgh", [A, B]) == {A: 0, B: 8}


def test_prefix_index_evicts_tails_before_heads():
    idx = PrefixIndex(chunk_chars=2, max_entries=3)
    idx.insert("aabbcc", A)  # 3 entries
    idx.insert("xx", B)  # evicts the oldest: the deepest chunk of the first prompt
    assert idx.match("aabbcc", [A]) == {A: 4}
    assert len(idx) == 3


def test_cache_aware_follows_the_prefix_and_least_load_does_not():
    pool = _pool()
    first = pool.choose("shared system prompt, then question one").upstream.url
    for q in ("two", "three", "four"):
        assert pool.choose(f"shared system prompt, then question {q}").upstream.url == first
    other = pool.choose("a different prompt entirely").upstream.url
    assert other != first  # below the cache threshold: the idler (fewer assigned) replica
    rr = _pool("least_load")
    urls = {rr.choose(f"shared system prompt, then question {q}").upstream.url for q in ("one", "two")}
    assert urls == {A, B}


def test_imbalance_overrides_the_prefix():
    pool = _pool(balance_abs_threshold=4, balance_rel_threshold=1.5)
    a, b = pool.upstreams
    assert pool.choose("shared system prompt, then question one").upstream is a
    a.in_flight, b.waiting = 10, 1  # 10 vs 1: past both thresholds
    assert pool.choose("shared system prompt, then question two").upstream is b
    a.in_flight = 3  # 3 vs 1: within the absolute threshold; both hold the prefix now: the idler
    assert pool.choose("shared system prompt, then question three").upstream is b
    pool.index.forget(B)  # only a holds it: affinity again, though a is busier
    assert pool.choose("shared system prompt, then question four").upstream is a


def test_unhealthy_and_excluded_replicas_are_skipped():
    pool = _pool()
    pool.upstreams[0].mark_unhealthy("test")
    assert all(pool.choose(f"p{i}").upstream.url == B for i in range(3))
    assert pool.choose("p", exclude=frozenset({B})) is None


def test_ties_break_on_kv_usage_then_turns():
    pool = _pool("least_load")
    assert [pool.choose(f"y{i}").upstream.url for i in range(4)] == [A, B, A, B]  # idle: turns
    pool.upstreams[1].kv_usage = 0.5
    assert [pool.choose(f"z{i}").upstream.url for i in range(2)] == [A, A]  # B's KV cache fuller


def test_prefill_leg_rewrites_only_what_vllm_proxy_rewrites():
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.3}
    leg = prefill_leg(body)
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and leg["temperature"] == 0.3
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # the original is untouched
    assert "max_completion_tokens" not in prefill_leg({"prompt": "p"})


def test_prompt_text_and_single_sequence():
    assert prompt_text({"prompt": [5, 6]}, chat=False) == "5 6"
    assert prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, chat=True) \
        == "<user>hi\n"
    assert single_sequence({"prompt": ["a"]}, chat=False)
    assert not single_sequence({"prompt": ["a", "b"]}, chat=False)
    assert not single_sequence({"messages": [], "n": 2}, chat=True)


def test_parse_load_sums_label_sets():
    text = ('# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{model_name="a"} 2.0\n'
            'vllm:num_requests_waiting{model_name="b"} 1.0\nvllm:num_requests_running 3\n'
            'vllm:kv_cache_usage_perc{model_name="a"} 0.5\nvllm:num_requests_waiting_other 9\n')
    assert parse_load(text) == {"vllm:num_requests_waiting": 3.0, "vllm:num_requests_running": 3.0,
                                "vllm:kv_cache_usage_perc": 0.5}


def test_router_never_imports_torch():
    from pathlib import Path

    import stoker.router

    modules = sorted(f"stoker.router.{p.stem}" for p in Path(stoker.router.__file__).parent.glob("*.py"))
    code = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, m\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        _pool("fastest")


def test_load_counts_own_requests_exactly_and_others_as_scraped():
    u = Upstream(A, "worker")
    u.in_flight, u.running, u.waiting, u.in_flight_at_scrape = 2, 3.0, 1.0, 2  # scrape: 2 ours + 2 others
    assert u.load == 4
    u.in_flight = 0  # ours finished since the scrape: not counted again
    assert u.load == 2


def test_a_recovered_replica_starts_with_an_empty_prefix_record():
    from stoker.router.app import Router
    from stoker.router.config import RouterConfig

    router = Router(RouterConfig(workers=(A, B), prefix_chunk_chars=8))
    text = "shared system prompt, then a question"
    first = router.pool.choose(text).upstream
    assert router.pool.index.match(text, [first.url])[first.url] > 0
    router.recovered(first)  # it restarted: its prefix cache is gone
    assert router.pool.index.match(text, [first.url])[first.url] == 0


def test_read_body_from_asgi_messages():
    import asyncio

    from stoker.router.requests import BodyTooLarge, ClientGone, read_body

    def receiver(*messages):
        it = iter(messages)

        async def receive():
            return next(it)
        return receive

    part = {"type": "http.request", "more_body": True}
    assert asyncio.run(read_body(receiver({**part, "body": b'{"a"'}, {"type": "http.request", "body": b": 1}"}),
                                 b"8", 100)) == b'{"a": 1}'
    with pytest.raises(BodyTooLarge):  # refused on the declared length, before reading
        asyncio.run(read_body(receiver(), b"101", 100))
    with pytest.raises(BodyTooLarge):  # and on what arrives, with no length declared
        asyncio.run(read_body(receiver({**part, "body": b"x" * 60}, {**part, "body": b"x" * 60}), None, 100))
    with pytest.raises(ClientGone):
        asyncio.run(read_body(receiver({**part, "body": b"{"}, {"type": "http.disconnect"}), None, 100))
