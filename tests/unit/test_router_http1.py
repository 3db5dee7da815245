"""The router's relay client (stoker/router/http1.py) and relay response against a scripted
in-process HTTP server: keep-alive reuse, the three ways a body ends, a connection the server
closed while idle, disconnect propagation, refusals and deadlines, TCP_NODELAY."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from stoker.router.http1 import HTTP1Pool, UpstreamConnectionError, UpstreamTimeout
from stoker.router.proxy import RelayResponse, UpstreamUnavailable, send
from stoker.router.upstream import Upstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


class Server:
    """Accepts connections and runs `handler(reader, writer, connection_number)` on each."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections, self.closed_by_peer = handler, 0, asyncio.Event()

    async def __aenter__(self) -> str:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (asyncio.IncompleteReadError, ConnectionError):
                self.closed_by_peer.set()
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def sse(*events: bytes) -> bytes:
    """A chunked text/event-stream answer, each event one HTTP chunk, then the end."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + body + b"0\r\n\r\n")


def test_keep_alive_reuse_and_every_body_framing():
    async def handler(reader, writer, n):
        while True:
            head, body = await read_request(reader)
            assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"x-request-id: r1" in head
            if body == b"length":  # the body in two writes
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{\"a\"")
                await writer.drain()
                writer.write(b": 1}")
            elif body == b"large":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (3 << 20) + b"x" * (3 << 20))
            elif body == b"chunked":
                writer.write(sse(b"data: 1\n\n", b"data: 2\n\n"))
            else:  # no length, no chunking: the body ends with the connection
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nuntil close")
                await writer.drain()
                return
            await writer.drain()

    async def main():
        srv = Server(handler)
        async with srv as url:
            pool = HTTP1Pool(url, connect_timeout_s=5)
            r = await pool.post("/v1/completions", b"length", {"x-request-id": "r1"})
            assert (r.status, r.headers["content-type"]) == (200, "application/json")
            assert await r.read() == b'{"a": 1}'
            r.release()
            r = await pool.post("/v1/completions", b"chunked", {"x-request-id": "r1"})
            pieces = []
            while (piece := await r.next_chunk()) is not None:
                pieces.append(piece)
            assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\n" and r.at_eof
            r.release()
            assert pool.num_idle == 1
            r = await pool.post("/v1/completions", b"large", {"x-request-id": "r1"})
            assert await asyncio.wait_for(r.read(), 10) == b"x" * (3 << 20)  # past the read-pause threshold
            r.release()
            r = await pool.post("/v1/completions", b"close", {"x-request-id": "r1"})
            assert await r.read() == b"until close"
            r.release()
            assert srv.connections == 1 and pool.num_idle == 0  # one connection for all; closed at the end
            pool.close()

    asyncio.run(main())


def test_connections_are_reused_and_a_dead_idle_one_is_replaced():
    async def handler(reader, writer, n):
        _, body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if n == 1:  # the first connection serves two requests, then the server closes it while idle
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def main():
        srv = Server(handler)
        async with srv as url:
            pool = HTTP1Pool(url, connect_timeout_s=5)
            for _ in range(3):
                r = await pool.post("/x", b"{}", {})
                assert await r.read() == b"ok"
                r.release()
            # Requests 1 and 2 shared a connection; the server closed it after the second, so
            # the third was sent on a new one: no error reached the caller.
            assert srv.connections == 2
            pool.close()

    asyncio.run(main())


def test_stale_connection_closed_without_notice_is_retried_once():
    """The server closed an idle connection and the close has not been seen yet when the next
    request is written: no answer byte came back, so the request goes out on a fresh connection."""

    async def handler(reader, writer, n):
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await read_request(reader)  # the second request: dropped without an answer
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfresh")
        await writer.drain()

    async def main():
        srv = Server(handler)
        async with srv as url:
            pool = HTTP1Pool(url, connect_timeout_s=5)
            r = await pool.post("/x", b"{}", {})
            assert await r.read() == b"ok"
            r.release()
            r = await pool.post("/x", b"{}", {})
            assert await r.read() == b"fresh" and srv.connections == 2
            r.release()
            pool.close()

    asyncio.run(main())


def test_refused_timeout_and_nodelay():
    async def slow(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(UpstreamConnectionError, match="cannot connect"):
            await HTTP1Pool(dead, connect_timeout_s=5).post("/x", b"{}", {})
        async with Server(slow) as url:
            pool = HTTP1Pool(url, connect_timeout_s=5)
            r = await pool.post("/x", b"{}", {}, timeout_s=0.3)  # headers in time, the body not
            (conn,) = pool._busy
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            with pytest.raises(UpstreamTimeout):
                await r.next_chunk()
            r.close()
            pool.close()

    asyncio.run(main())


def _relay(events_from_server: Handler, watch_disconnect_after: int | None = None):
    """Relay one streamed answer through send() + RelayResponse; the ASGI messages the client
    side would have been sent, and whether the upstream saw the connection closed."""

    async def main():
        srv = Server(events_from_server)
        async with srv as url:
            up = Upstream(url, "worker")
            pool = HTTP1Pool(url, connect_timeout_s=5)
            outcome = {}
            resp = await send(pool, up, "/v1/completions", b"{}", {}, True, None,
                              lambda: outcome.setdefault("first", 1),
                              lambda err: outcome.setdefault("done", err))
            assert isinstance(resp, RelayResponse) and up.in_flight == 1
            sent: list[dict] = []
            gone = asyncio.Event()

            async def receive():
                await gone.wait()
                return {"type": "http.disconnect"}

            async def asgi_send(message):
                sent.append(message)
                bodies = [m for m in sent if m["type"] == "http.response.body"]
                if watch_disconnect_after is not None and len(bodies) == watch_disconnect_after:
                    gone.set()
                    await asyncio.sleep(0.05)  # the watcher closes the upstream connection

            await resp({"type": "http"}, receive, asgi_send)
            if watch_disconnect_after is not None:
                await asyncio.wait_for(srv.closed_by_peer.wait(), 5)
            pool.close()
            return sent, outcome, up

    return asyncio.run(main())


def test_relay_passes_chunks_on_and_ends_with_the_last():
    async def server(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the first event comes later than the headers
        writer.write(b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")  # the last event and the end together
        await writer.drain()
        await reader.read()  # keep-alive: wait until the router lets go

    sent, outcome, up = _relay(server)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[1] == {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True}
    assert sent[2] == {"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False}
    assert outcome == {"first": 1, "done": None} and up.in_flight == 0


def test_relay_client_leaving_closes_the_upstream_connection():
    async def server(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(200):
            writer.write(b"9\r\ndata: x\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        raise AssertionError("the router never closed the connection")

    sent, outcome, up = _relay(server, watch_disconnect_after=2)
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert outcome["done"] is None and up.in_flight == 0  # a client leaving is not an upstream error


def test_relay_503_and_refused_are_unavailable():
    async def busy(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    async def main():
        async with Server(busy) as url:
            up = Upstream(url, "worker")
            errors = []
            with pytest.raises(UpstreamUnavailable, match="503"):
                await send(HTTP1Pool(url, 5), up, "/x", b"{}", {}, True, None, lambda: None, errors.append)
            assert errors == ["status_503"] and up.in_flight == 0

    asyncio.run(main())
