"""HTTP-layer limits uvicorn does not enforce itself: a deadline for a request's headers,
malformed HTTP answered in OpenAI's error shape, and an access log that never carries a secret.

Headers: uvicorn waits for a request's headers for ever, so a client that opens connections
and trickles bytes (slowloris) holds them open indefinitely. `header_timeout_protocol(s)`
returns uvicorn's HTTP protocol with a deadline: the request line and headers must be complete
within `s` seconds of the connection opening or of the previous response; else the connection
gets a 408 and is closed. (The body's deadline is Gatekeeper's, middleware.py.)

Which protocol: httptools (uvicorn's C parser, what `uvicorn[standard]` runs) when installed,
else h11 (pure Python), chosen once when the server is built. httptools costs the event loop
less per request: a bare FastAPI POST took 145 us of server CPU against 272 us with h11
(benchmarks/http_protocol_cpu.py; docs/benchmarks.md, "The HTTP protocol"), which on a small machine is CPU the model's forward
gets back.

Secrets: uvicorn's access log writes the full path with its query string, so a client that
put its key in `?api_key=` had it written to the log (issue 20; the key is only ever read from
headers). `RedactSecrets` blanks such query values in the access log.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from stoker.server.errors import error_bytes

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # httptools not installed: h11 only
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


class _HeaderDeadline:
    """The deadline's timer, for either uvicorn protocol (mixed in before it): armed when the
    connection opens (and, by the subclass, after each response), cancelled when it closes;
    `_headers_too_slow` (the subclass's) runs when it fires."""

    header_timeout_s: float = 10.0
    _header_timer: Any = None
    loop: Any

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _headers_too_slow(self) -> None:
        raise NotImplementedError


class _H11WithHeaderTimeout(_HeaderDeadline, H11Protocol):
    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # the headers came (a request is being read or answered)
        self._send_error_and_close(408, f"the request's headers did not arrive within {self.header_timeout_s:g} s")

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP: uvicorn answers plain text; this server answers in OpenAI's error shape."""
        self._send_error_and_close(400, f"malformed HTTP request: {msg}")

    def _send_error_and_close(self, status: int, message: str) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = error_bytes(status, message)
            response = h11.Response(status_code=status, headers=[("content-type", "application/json"),
                                                                 ("content-length", str(len(body))), ("connection", "close")])
            try:
                self.transport.write(self.conn.send(response) + self.conn.send(h11.Data(data=body))
                                     + self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers get the same deadline


if HttpToolsProtocol is not None:
    class _HttpToolsWithHeaderTimeout(_HeaderDeadline, HttpToolsProtocol):
        """The same deadline and error shape on uvicorn's httptools protocol: armed when the
        connection opens and after each response (unless a pipelined request is already parsed),
        cancelled when a request's headers are complete."""

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return  # a request is being answered
            self._send_error_and_close(408, f"the request's headers did not arrive within {self.header_timeout_s:g} s")

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            """Malformed HTTP: uvicorn answers plain text; this server answers in OpenAI's error shape."""
            self._send_error_and_close(400, f"malformed HTTP request: {msg}")

        def _send_error_and_close(self, status: int, message: str) -> None:
            if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                body = error_bytes(status, message)
                head = STATUS_LINE[status] + (b"content-type: application/json\r\ncontent-length: %d\r\n"
                                              b"connection: close\r\n\r\n" % len(body))
                self.transport.write(head + body)
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._arm_header_timer()  # the next request's headers get the same deadline


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with a `timeout_s`
    deadline for each request's headers and malformed requests answered in OpenAI's shape."""
    base = _HttpToolsWithHeaderTimeout if HttpToolsProtocol is not None else _H11WithHeaderTimeout
    return type(base.__name__.lstrip("_"), (base,), {"header_timeout_s": float(timeout_s)})


_SECRET_PARAM = re.compile(r"((?:^|[?&;])[^=&;]*(?:key|token|secret|password|auth)[^=&;]*=)[^&;\s\"]*", re.IGNORECASE)


def redact(text: str) -> str:
    return _SECRET_PARAM.sub(r"\1REDACTED", text)


class RedactSecrets(logging.Filter):
    """Blank the values of query parameters named like keys or tokens in uvicorn's access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) and "=" in a else a for a in record.args)
        return True


def install_redaction() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSecrets) for f in access.filters):
        access.addFilter(RedactSecrets())
