"""What real clients rely on (issue 15): readiness, the first-token time of streamed chat,
and the sampling extras vLLM clients send."""

from __future__ import annotations

import time

from openai import OpenAI

from tests.server.conftest import MODEL, LiveServer


def test_streamed_chat_sends_the_role_with_the_first_token(server_factory) -> None:
    """The role chunk used to go out before the prefill ran, so a client's TTFT was the
    request's arrival; it now goes with the first output, as vLLM sends it."""
    live: LiveServer = server_factory()
    engine = live.engine
    real_step = engine.step

    def slow_step():  # every step takes 0.3 s: a visible prefill
        time.sleep(0.3)
        return real_step()

    engine.step = slow_step
    try:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        start = time.monotonic()
        arrivals = []
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, stream=True, temperature=0)
        for chunk in stream:
            if chunk.choices:
                d = chunk.choices[0].delta
                arrivals.append(("role" if d.role else "content", time.monotonic() - start))
    finally:
        del engine.step
    assert arrivals[0][0] == "role" and [k for k, _ in arrivals].count("role") == 1
    role_t = arrivals[0][1]
    assert role_t >= 0.3, f"the role chunk came {role_t:.3f} s after the request, before the first step ended"
