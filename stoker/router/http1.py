"""A lean HTTP/1.1 client for the relay leg: one POST to an upstream, its answer as raw bytes. [no torch]

Why not aiohttp's client here: on loopback, aiohttp's request machinery (ClientRequest and
ClientResponse objects, yarl URLs, multidicts, StreamReader, timer contexts, trace hooks) was
about half of the router's CPU per relayed request (docs/benchmarks.md, Router), and every
microsecond of it sits on the TTFT path. This client does one thing: a POST with a body
already encoded, written in one send, the answer parsed by httptools (llhttp, the parser
uvicorn uses) straight into a list of body chunks that the relay forwards as they come.

Connections are kept alive per upstream and reused last-in first-out (the warmest socket
first); an idle connection the server closed is dropped when its close arrives, and a
request whose reused connection turns out dead before any answer byte is sent once more on a
fresh one (the server never read it). TCP_NODELAY is set on every socket (uvloop and asyncio
do it too), so a request or a small SSE event is never held back by Nagle's algorithm.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from urllib.parse import urlsplit

import httptools


class UpstreamConnectionError(ConnectionError):
    """The upstream could not be reached, or closed the connection before a complete answer.
    `kind` names the failure for the router's upstream_errors metric."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind  # connect_error, connect_timeout, disconnected or bad_answer


class UpstreamTimeout(asyncio.TimeoutError):
    """The request's deadline passed before its answer was complete."""


# Pause reading from the upstream while this much answer is buffered and not yet passed on
# (a client slower than the server): the server's own send buffer then fills, as it would
# with the client connected directly.
_HIGH_WATER = 1 << 20


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time on it."""

    def __init__(self, pool: HTTP1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.got_bytes = False  # any answer byte on this request: a retry is no longer safe
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self._read_until_close = False  # no content-length, not chunked: the body ends with the connection
        if getattr(self, "paused", False) and self.transport is not None:
            self.transport.resume_reading()
        self.paused = False

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - a POST is never upgraded
            self._fail(UpstreamConnectionError("the upstream switched protocols", "bad_answer"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamConnectionError(f"malformed answer: {exc}", "bad_answer"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.headers_done and not self.complete and self.error is None and self._read_until_close:
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
        elif not self.complete and self.error is None:
            self._fail(UpstreamConnectionError(f"the upstream closed the connection{f': {exc}' if exc else ''}",
                                               "disconnected"))

    # --- httptools callbacks (the parser's names) -----------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self._read_until_close = ("content-length" not in self.headers
                                  and "chunked" not in self.headers.get("transfer-encoding", "").lower())
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # --- the request side -----------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self._wake()

    async def wait(self) -> None:
        """Until something new arrived (headers, a body chunk, the end, an error)."""
        if self.error is not None:
            raise self.error
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data


class UpstreamResponse:
    """An answer being received: status and headers are in; the body comes with `read` (whole)
    or `iter_chunks` (as it arrives). `release` or `close` ends it exactly once."""

    def __init__(self, conn: _Connection, timer: asyncio.TimerHandle | None) -> None:
        self._conn, self._timer = conn, timer
        self.status = conn.status
        self.headers = conn.headers  # lower-case names
        self._ended = False

    @property
    def at_eof(self) -> bool:
        """The whole body has arrived and been taken."""
        return self._conn.complete and not self._conn.chunks

    async def read(self) -> bytes:
        """The whole body. Taken piece by piece as it arrives, so that a body larger than the
        read-pause threshold keeps flowing."""
        conn, parts = self._conn, []
        while True:
            if conn.chunks:
                parts.append(conn.take())
            elif conn.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            else:
                await conn.wait()

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some if none did), or
        None at the end of the body."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.complete:
                return None
            await conn.wait()

    def release(self) -> None:
        """The answer was read whole: the connection goes back to the pool (if the server keeps it)."""
        if self._ended:
            return
        self._ended = True
        self._cancel_timer()
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            conn.pool._put(conn)
        else:
            conn.pool._discard(conn)

    def close(self) -> None:
        """Abandon the answer: the connection is closed, which tells the server the client left
        (it aborts the request and frees its KV blocks)."""
        if self._ended:
            return
        self._ended = True
        self._cancel_timer()
        self._conn.pool._discard(self._conn)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class HTTP1Pool:
    """Keep-alive connections to one upstream (`http://host:port` or `https://...`). No cap on
    open connections (the servers have their own admission limits); at most `max_idle` are
    kept between requests, for as long as the server keeps them (uvicorn: 5 s idle)."""

    def __init__(self, url: str, connect_timeout_s: float, max_idle: int = 256) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {url!r}: use http://host:port")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self._host_header = parts.netloc.encode("idna")
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamConnectionError(f"connect timeout after {self.connect_timeout_s:g} s",
                                          "connect_timeout") from None
        except OSError as exc:
            raise UpstreamConnectionError(f"cannot connect: {exc}", "connect_error") from exc
        return conn

    def _put(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if len(self._idle) >= self.max_idle:
            conn.transport.close()  # type: ignore[union-attr]
            return
        conn._reset()
        conn.reused = True
        self._idle.append(conn)

    def _discard(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if not conn.closed and conn.transport is not None:
            conn.transport.abort()  # at once: the server must see the disconnect now

    def _forget(self, conn: _Connection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        for conn in self._idle + list(self._busy):
            if conn.transport is not None:
                conn.transport.abort()
        self._idle.clear()
        self._busy.clear()

    async def post(self, path: str, body: bytes, headers: dict[str, str],
                   timeout_s: float | None = None) -> UpstreamResponse:
        """Send the request and wait for the answer's status and headers. Raises
        UpstreamConnectionError (nothing came back: the request may go elsewhere) or
        UpstreamTimeout; a deadline (`timeout_s`) also covers the body's arrival."""
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nhost: ", self._host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers.items():
            head += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        request = b"".join(head) + body
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            conn = self._idle.pop() if self._idle else await self._connect()
            if conn.transport.is_closing():  # type: ignore[union-attr]  # closed while idle, not yet told
                continue
            self._busy.add(conn)
            timer = None
            if deadline is not None:
                expired = UpstreamTimeout(f"no complete answer within {timeout_s:g} s")
                timer = loop.call_at(deadline, conn._fail, expired)
            try:
                conn.transport.write(request)  # type: ignore[union-attr]
                while not conn.headers_done:
                    await conn.wait()
            except UpstreamConnectionError:
                if timer is not None:
                    timer.cancel()
                self._discard(conn)
                if conn.reused and not conn.got_bytes:  # the server had closed it while idle
                    continue
                raise
            except BaseException:
                if timer is not None:
                    timer.cancel()
                self._discard(conn)
                raise
            return UpstreamResponse(conn, timer)
