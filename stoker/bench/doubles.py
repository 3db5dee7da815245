"""Test doubles: a tiny OpenAI-compatible streaming server that behaves (or misbehaves).

Used by the bench tests and by `benchmarks/bench_client_overhead.py`. It is a bare
asyncio HTTP/1.1 server (keep-alive, chunked transfer encoding) rather than a web
framework so that it costs as little CPU as possible: the client under test must be the
bottleneck, not the double. Behaviours (`mode`):

  instant    stream max_tokens one-token chunks, a usage chunk, then [DONE], all at once
             (or one write per token with chunk_writes=True, like a real server)
  nousage    as instant but without the usage chunk (the client must count tokens itself)
  http_error answer 500 with an OpenAI error body
  sse_error  200, two content chunks, then an SSE error payload (vLLM/OpenAI shape)
  empty      200, a role-only chunk and [DONE]: a stream without content
  truncated  200, content chunks, then the connection closes without [DONE]
  hang       200 headers, then nothing until the client gives up
  mixed      cycles instant, http_error, sse_error, empty, hang per request

With `close_reused=True` a kept-alive connection's second request is read and the connection
closed without an answer, as llama-server does after a streamed response (its HTTP library
does not keep those connections, and does not say so): the client must resend on a new one.

Run standalone: `python -m stoker.bench.doubles --mode instant --port 0` prints
`READY <port>` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections import Counter
from dataclasses import dataclass, field

MODES = ("instant", "nousage", "http_error", "sse_error", "empty", "truncated", "hang")
MIXED_CYCLE = ("instant", "http_error", "sse_error", "empty", "hang")


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _content_event(chat: bool, i: int) -> bytes:
    token = f" t{i}"
    if chat:
        choice = {"index": 0, "delta": {"content": token}, "finish_reason": None}
        return _event({"id": "d", "object": "chat.completion.chunk", "choices": [choice]})
    choice = {"index": 0, "text": token, "finish_reason": None}
    return _event({"id": "d", "object": "text_completion", "choices": [choice]})


_OK_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


@dataclass
class DoubleServer:
    """An in-process double on 127.0.0.1 running in its own thread and event loop."""

    mode: str = "instant"
    model: str = "double-model"
    port: int = 0
    hang_s: float = 60.0
    token_delay_s: float = 0.0  # > 0: sleep between chunks (a slow-decoding server)
    max_running: int = 0  # > 0: at most this many streams at once, others queue (a batch cap)
    chunk_writes: bool = False  # True: one socket write (and event-loop turn) per token, as servers do
    close_reused: bool = False  # True: a connection's second request is dropped, the connection closed
    stats: Counter[str] = field(default_factory=Counter)
    _cache: dict[tuple[bool, int, bool], bytes] = field(default_factory=dict)
    _n: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES + ("mixed",):
            raise ValueError(f"unknown double mode {self.mode!r}; pick one of {MODES + ('mixed',)}")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots: asyncio.Semaphore | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle --------------------------------------------------------------------
    async def start_async(self) -> None:
        if self.max_running > 0:
            self._slots = asyncio.Semaphore(self.max_running)
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop_async(self) -> None:
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def __enter__(self) -> DoubleServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.start_async())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self.stop_async())
            self._loop.close()

        self._thread = threading.Thread(target=run, name=f"double-{self.mode}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("test double did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- HTTP -------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        served = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for h in lines[1:]:
                    if h.lower().startswith("content-length:"):
                        length = int(h.split(":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                if self.close_reused and served:
                    self.stats["dropped_on_reused_connection"] += 1
                    return
                served += 1
                keep = await self._respond(method, path, body, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._tasks.discard(task)
            writer.close()

    def _json(self, writer: asyncio.StreamWriter, status: str, obj: object) -> None:
        data = json.dumps(obj).encode()
        writer.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (status.encode(), len(data), data))

    async def _respond(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if method == "GET" and path.startswith("/v1/models"):
            self._json(writer, "200 OK", {"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "stoker-bench-double"}]})
            await writer.drain()
            return True
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            self._json(writer, "404 Not Found", {"error": {"message": f"no route {path}", "type": "NotFound"}})
            return True
        req = json.loads(body)
        chat = path.endswith("chat/completions")
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        mode = self.mode
        if mode == "mixed":
            mode = MIXED_CYCLE[self._n % len(MIXED_CYCLE)]
        self._n += 1
        self.stats[mode] += 1
        if mode == "http_error":
            self._json(writer, "500 Internal Server Error",
                       {"error": {"message": "double: injected failure", "type": "InternalServerError",
                                  "param": None, "code": 500}})
            await writer.drain()
            return True
        writer.write(_OK_HEAD)
        if mode in ("instant", "nousage") and self.token_delay_s <= 0 and self._slots is None \
                and not self.chunk_writes:
            writer.write(self._instant_body(chat, n, mode == "instant", req))
        elif mode in ("instant", "nousage"):
            if self._slots is not None:
                await self._slots.acquire()  # queued: the wait shows up as TTFT, as in a real server
            try:
                for i in range(n):
                    writer.write(_chunk(_content_event(chat, i)))
                    await writer.drain()
                    await asyncio.sleep(self.token_delay_s)
            finally:
                if self._slots is not None:
                    self._slots.release()
            if mode == "instant":
                writer.write(_chunk(self._usage_event(chat, n, req)))
            writer.write(_DONE)
        elif mode == "sse_error":
            writer.write(_chunk(_content_event(chat, 0)) + _chunk(_content_event(chat, 1)))
            err = {"error": {"message": "double: engine died mid-stream", "type": "InternalServerError",
                             "param": None, "code": 500}}
            writer.write(_chunk(_event(err)) + _DONE)
        elif mode == "empty":
            role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            writer.write(_chunk(_event(role)) + _DONE)
        elif mode == "truncated":
            writer.write(_chunk(_content_event(chat, 0)) + _chunk(_content_event(chat, 1)) + b"0\r\n\r\n")
            await writer.drain()
            return False
        elif mode == "hang":
            await writer.drain()
            await asyncio.sleep(self.hang_s)
            return False
        await writer.drain()
        return True

    def _usage_event(self, chat: bool, n: int, req: dict) -> bytes:
        prompt = req.get("prompt") or " ".join(m.get("content", "") for m in req.get("messages", []))
        usage = {"prompt_tokens": len(str(prompt).split()), "completion_tokens": n,
                 "total_tokens": len(str(prompt).split()) + n}
        return _event({"id": "d", "choices": [], "usage": usage})

    def _instant_body(self, chat: bool, n: int, usage: bool, req: dict) -> bytes:
        key = (chat, n, usage)
        if key not in self._cache:  # the same response bytes every time: keep the double cheap
            self._cache[key] = b"".join(_chunk(_content_event(chat, i)) for i in range(n))
        body = self._cache[key]
        if usage:
            body += _chunk(self._usage_event(chat, n, req))
        return body + _DONE


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a bench test double on 127.0.0.1")
    parser.add_argument("--mode", default="instant", choices=MODES + ("mixed",))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="double-model")
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="sleep between streamed tokens")
    parser.add_argument("--max-running", type=int, default=0, help="streams served at once (0 = no cap)")
    parser.add_argument("--chunk-writes", action="store_true", help="one socket write per streamed token")
    args = parser.parse_args()

    async def serve() -> None:
        server = DoubleServer(mode=args.mode, port=args.port, model=args.model,
                              token_delay_s=args.token_delay_ms / 1000.0, max_running=args.max_running,
                              chunk_writes=args.chunk_writes)
        await server.start_async()
        print(f"READY {server.port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
