"""The HTTP/1.1 connection guard: uvicorn's httptools protocol with the limits it lacks.

uvicorn (0.54) has an idle keep-alive timeout but no limit on the size of a request head when
it parses with httptools, no deadline for a head to arrive (a slowloris holds a connection and
its buffer forever), and a concurrency limit that answers only once a request has arrived. This
subclass adds, per connection: a cap on open connections (503 and close at once), and below it a
cap per client address (so one client cannot hold them all), with a few connections past the
cap kept for ``GET /health``, ``/ready`` and ``/metrics`` (a supervisor and Prometheus still get
an answer when the rest are taken); a deadline for the request line and headers (408), a size
limit on them (431), and the idle timeout from the first byte on (uvicorn arms it only after a
first response). Bodies are limited by
``middleware.BodyGuard`` (413, 408), authentication by ``middleware.AuthGate``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from veloxquant_mlx.server.errors import error_body

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


_LINGER_SECONDS = 1.0
# Connections past --max-connections that may still ask for these (GET only).
RESERVED = 8
# Seconds a request whose client closed its side may take to start its response before the
# connection is probed (a half-closed client's answer has mostly started by then, a stream's
# first event or a short completion), and between probes after that.
EOF_GRACE = 2.0
# A probe is an interim response (RFC 9110: a client must parse 1xx it did not ask for); a
# client that closed its socket answers it with a reset, which the next write, this long
# after, meets: its request is cancelled. A half-closed client reads on and keeps it.
PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
PROBE_CHECK = 0.5
OPS_PATHS = (b"/health", b"/ready", b"/metrics")


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """Per-connection limits (from Settings)."""

    max_connections: int
    max_header_bytes: int
    header_timeout: float
    max_connections_per_client: int = 1 << 30
    # Addresses not held to the per-client cap (a reverse proxy: all its clients share them).
    trusted_proxies: frozenset[str] = frozenset()


class _HeadRejected(Exception):
    """Raised out of a parser callback to stop parsing a rejected request head."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection. Owns, besides uvicorn's state: whether a request head is being read,
    its byte count so far and its deadline timer. Event-loop thread only."""

    limits: EdgeLimits  # set on the subclass that ``protocol_class`` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._rejected = False
        self._eof = False  # the client half-closed with a request in flight
        self._eof_timer: asyncio.TimerHandle | None = None
        # Over a cap: answered 503 when its request arrives (answering before it is read
        # would make the client's write meet a closed socket: a reset, not a response).
        n_open, cap = len(self.connections), self.limits.max_connections
        self._over_cap = n_open > cap + RESERVED
        self._ops_only = cap < n_open <= cap + RESERVED  # a reserved one: health and metrics
        self._over_client_cap = False
        peer = self.client[0] if self.client else None
        if peer is not None and peer not in self.limits.trusted_proxies:
            same = sum(1 for c in self.connections if _peer(c) == peer)
            self._over_client_cap = same > self.limits.max_connections_per_client
        # A connection that never sends a byte is idle too.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._eof_timer is not None:
            self._eof_timer.cancel()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client closed its side with a complete request in flight. That is either a
        half-close, which HTTP allows (``shutdown(SHUT_WR)`` after the request), or the client
        gone (a timeout, a crash): the same FIN. Keep the connection open to answer: a
        response under way shows a real close at its next write. One not started within
        ``EOF_GRACE`` seconds is probed (``PROBE``): a client that is gone answers with a
        reset, the next probe's write fails, and its request is cancelled (as uvicorn did at
        once), so a vanished client holds its blocks about ``EOF_GRACE + PROBE_CHECK``
        seconds; a half-closed one waits for its answer however long it takes."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            return None  # nothing to answer, or a body that will never come: close
        self._eof = True
        if not cycle.response_started:
            self._eof_timer = self.loop.call_later(EOF_GRACE, self._probe, PROBE_CHECK)
        return True  # keep the transport open for writing

    def _probe(self, next_in: float) -> None:
        """Write a probe while the answer has not started; a write to a client that reset the
        connection fails, and asyncio's ``connection_lost`` tells the app it is gone."""
        cycle = self.cycle
        if cycle is None or cycle.response_started or cycle.response_complete:
            return
        if self.transport.is_closing():
            return
        self.transport.write(PROBE)
        self._eof_timer = self.loop.call_later(next_in, self._probe, EOF_GRACE)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._eof and not self.pipeline and not self.transport.is_closing():
            self.transport.close()  # answered; the client sends nothing more

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        if self._over_cap:
            self._reject(503, "too many open connections; try again later", "too_many_connections")
            return
        if self._over_client_cap:
            self._reject(
                503,
                "too many open connections from this client; close some and try again",
                "too_many_connections",
            )
            return
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(
                    self.limits.header_timeout, self._head_timed_out
                )
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.send_400_response("Upgrades are not supported.")
            return
        except httptools.HttpParserError:
            if not self._rejected:
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._head_too_large()

    # Parser callbacks (uvicorn's, plus the head bookkeeping)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._head_too_large()
            raise _HeadRejected
        if self._ops_only and not (
            self.parser.get_method() == b"GET" and self.url.split(b"?")[0] in OPS_PATHS
        ):
            self._reject(503, "too many open connections; try again later", "too_many_connections")
            raise _HeadRejected
        self._in_head = False
        self._head_bytes = 0
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request's head, if any, starts here

    # Rejections

    def send_400_response(self, msg: str) -> None:  # uvicorn's answers plain text
        """A request the parser cannot read: 400 in OpenAI's shape (``invalid_request``)."""
        self._reject(400, f"invalid HTTP request: {msg.rstrip('.')}", "invalid_request")

    def _head_too_large(self) -> None:
        self._reject(
            431,
            f"request line and headers over {self.limits.max_header_bytes} bytes",
            "headers_too_large",
        )

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._reject(
                408,
                f"request headers not received within {self.limits.header_timeout:g} s",
                "request_timeout",
            )

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()  # type: ignore[union-attr]
            self._head_timer = None

    def _reject(self, status: int, message: str, code: str) -> None:
        """Answer in OpenAI's error shape and close the connection."""
        self._rejected = True
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        body = json.dumps(error_body(status, message, code)).encode()
        retry = b"retry-after: 1\r\n" if status == 503 else b""
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"%sconnection: close\r\n\r\n" % (status, _REASONS[status], len(body), retry)
        )
        self.transport.write(head + body)
        # Half-close and linger: closing at once would reset the connection while the client
        # is still sending (a large head), and the reset destroys the answer in its buffers.
        # What still arrives is discarded (data_received returns while rejected).
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(_LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()


def _peer(connection: Any) -> str | None:
    client = getattr(connection, "client", None)
    return client[0] if client else None


def protocol_class(limits: EdgeLimits) -> type[Any]:
    """A protocol class for ``uvicorn.Config(http=...)`` bound to ``limits``."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})
