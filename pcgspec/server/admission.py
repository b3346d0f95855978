"""Who gets a connection: a global cap with a small reserve for /health and /metrics, a cap per
remote address, a deadline for the first request head, and OpenAI error bodies for requests
aiohttp's parser refuses.

A connection is admitted to a normal slot while fewer than ``limit`` are open and its address
holds fewer than ``per_peer``; else to one of ``reserve`` extra slots, where only /health and
/metrics are answered (then the connection closes), the oldest silent one giving way when they
are full (so idle sockets cannot hold them against a health check); else it gets a 503. Every
admitted connection must send a complete request head within ``header_timeout`` seconds (idle
and slow-drip connections are closed); later requests on it follow aiohttp's keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestHandler

from pcgspec.server.connections import RateLimit, fit_to_fd_limit
from pcgspec.server.validate import ApiError

logger = logging.getLogger("pcgspec")
_UNSUPPORTED_ENCODING = re.compile(r"content-encoding: \w+ \((\w+)\)")
RESERVE = 16  # connections over the cap that may still ask for /health or /metrics
RESERVED_PATHS = ("/health", "/metrics")
_BUSY = ApiError(
    503, "too many connections", type="service_unavailable", code="too_many_connections"
)


def _raw_response(error: ApiError) -> bytes:
    body = json.dumps(error.body()).encode()
    reason = HTTPStatus(error.status).phrase
    return (
        f"HTTP/1.1 {error.status} {reason}\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


_BUSY_RESPONSE = _raw_response(_BUSY)


class ConnectionCap:
    """The listener's protocol factory and the counts it admits by."""

    def __init__(
        self, server: web.Server, limit: int, per_peer: int, header_timeout: float, reserve: int
    ) -> None:
        self.server = server
        self.limit = limit
        self.per_peer = per_peer
        self.header_timeout = header_timeout
        self.reserve = reserve
        self.open = 0
        self.peers: Counter[str] = Counter()
        self.silent: dict[Connection, None] = {}  # reserve connections yet to send, oldest first
        self.refused = 0
        self._log = RateLimit()

    def __call__(self) -> Connection:
        # NOTE: aiohttp's Server keeps its handler arguments (keep-alive, logging) in _kwargs.
        kwargs: dict[str, Any] = self.server._kwargs  # type: ignore[attr-defined]
        return Connection(self, self.server, loop=asyncio.get_running_loop(), **kwargs)

    def admit(self, conn: Connection) -> str | None:
        """ "normal", "reserve", or None (refused); counts the connection when admitted. A full
        reserve makes room by closing its oldest connection that has sent nothing yet."""
        peer = conn.peer
        if self.open < self.limit and self.peers[peer] < self.per_peer:
            slot = "normal"
        elif self.open < self.limit + self.reserve or self._evict_silent():
            slot = "reserve"
            self.silent[conn] = None
        else:
            self.refused += 1
            if self._log.allow() is not None:
                logger.warning(
                    "%d connections open (--max-connections): refusing new ones (%d so far)",
                    self.open,
                    self.refused,
                )
            return None
        self.open += 1
        self.peers[peer] += 1
        return slot

    def _evict_silent(self) -> bool:
        if not self.silent:
            return False
        next(iter(self.silent)).close_now()
        return True

    def release(self, conn: Connection) -> None:
        self.silent.pop(conn, None)
        self.open -= 1
        self.peers[conn.peer] -= 1
        if not self.peers[conn.peer]:
            del self.peers[conn.peer]


def _peer_ip(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


class Connection(RequestHandler):
    """aiohttp's request handler, admitted by a ``ConnectionCap``."""

    __slots__ = ("cap", "peer", "slot", "counted", "_head_timer")

    def __init__(self, cap: ConnectionCap, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cap = cap
        self.peer = ""
        self.slot: str | None = None
        self.counted = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.peer = _peer_ip(transport)
        self.slot = self.cap.admit(self)
        self.counted = self.slot is not None
        if self.slot is None:
            assert isinstance(transport, asyncio.Transport)
            transport.write(_BUSY_RESPONSE)
            transport.close()
            return
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self.cap.header_timeout, self.force_close)

    def head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        if self.slot is not None:
            self.cap.silent.pop(self, None)
            super().data_received(data)

    def close_now(self) -> None:
        """Answer 503 and close, giving the slot back at once (not when the loss is reported)."""
        self._release()
        if self.transport is not None:
            self.transport.write(_BUSY_RESPONSE)
        self.force_close()

    def _release(self) -> None:
        if self.counted:
            self.counted = False
            self.head_arrived()
            self.cap.release(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.slot is None:
            return
        self._release()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse or handle, as an OpenAI error body
        that names no implementation detail."""
        super().handle_error(request, status, exc, message)  # logs; raises once output started
        error = http_error(status, exc)
        resp = web.json_response(error.body(), status=error.status)
        resp.force_close()
        return resp


def http_error(status: int, exc: BaseException | None) -> ApiError:
    """What a client is told of a request aiohttp could not parse: no implementation detail."""
    if status >= 500:
        return ApiError(status, "internal server error", type="internal_error")
    if isinstance(exc, ContentEncodingError):
        found = _UNSUPPORTED_ENCODING.search(str(exc))
        if found is None:
            return ApiError(
                400, "the body does not decode as its Content-Encoding", code="invalid_body"
            )
        return ApiError(
            415,
            f"Content-Encoding {found.group(1)!r} is not supported (send gzip, deflate or none)",
            code="unsupported_content_encoding",
        )
    text = f"malformed HTTP request ({HTTPStatus(status).phrase})"
    return ApiError(status, text, code="malformed_request")


@web.middleware
async def admission(request: web.Request, handler: Any) -> web.StreamResponse:
    """Stops the head deadline; on a reserve slot, answers only /health and /metrics, once."""
    conn = request.protocol
    if not isinstance(conn, Connection):
        return await handler(request)
    conn.head_arrived()
    if conn.slot != "reserve":
        return await handler(request)
    if request.path in RESERVED_PATHS:
        resp = await handler(request)
    else:
        resp = web.json_response(_BUSY.body(), status=503)
    resp.force_close()
    return resp


async def listen(
    runner: web.AppRunner,
    host: str,
    port: int,
    max_connections: int,
    per_peer: int | None = None,
    header_timeout: float = 5.0,
    reserve: int = RESERVE,
) -> asyncio.Server:
    """Serve ``runner``'s application on ``host:port`` under a ``ConnectionCap``; its app must
    run the ``admission`` middleware first."""
    assert runner.server is not None, "call runner.setup() first"
    limit = fit_to_fd_limit(max_connections + reserve) - reserve
    cap = ConnectionCap(runner.server, max(1, limit), per_peer or limit, header_timeout, reserve)
    loop = asyncio.get_running_loop()
    return await loop.create_server(cap, host, port, backlog=128, reuse_address=True)
