"""Connection limits and quiet logs: no client can exhaust file descriptors or fill the log.

Idle connections (before their first request too) close after the keep-alive timeout (aiohttp's
``keepalive_timeout``); connections over ``max_connections`` get a 503 and are closed at once;
the log lines a client can trigger at will are rate-limited and lose their tracebacks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

_CLIENT_FAULTS = (HttpProcessingError, web.RequestPayloadError)  # bad bytes from the client

logger = logging.getLogger("pcgspec")
FD_RESERVE = 128  # descriptors kept for the model files, the engine, logs and the listener
LOG_INTERVAL_S = 10.0


class RateLimit:
    """At most one event per ``interval`` seconds; ``allow`` returns how many were dropped
    since the last one allowed, or None to drop this one."""

    def __init__(
        self, interval: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ):
        self.interval = interval
        self.clock = clock
        self._next = float("-inf")
        self._dropped = 0

    def allow(self) -> int | None:
        now = self.clock()
        if now < self._next:
            self._dropped += 1
            return None
        dropped, self._dropped, self._next = self._dropped, 0, now + self.interval
        return dropped


class QuietClientErrors(logging.Filter):
    """Rate-limits the lines a client can cause: asyncio's "socket.accept() out of system
    resource", and aiohttp's errors for a malformed request or body (these lose their traceback
    and become warnings: the client, not the server, was at fault)."""

    def __init__(self) -> None:
        super().__init__()
        self._limits = {"accept": RateLimit(), "malformed": RateLimit()}

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, _CLIENT_FAULTS):
            kind = "malformed"
            record.msg, record.args = f"malformed request: {str(error)[:200]!r}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        elif str(record.msg).startswith("socket.accept() out of system resource"):
            kind = "accept"
        else:
            return True
        dropped = self._limits[kind].allow()
        if dropped:
            record.msg = f"{record.getMessage()} ({dropped} more like it not logged)"
            record.args = ()
        return dropped is not None


def install_log_filters() -> QuietClientErrors:
    quiet = QuietClientErrors()
    for name in ("asyncio", "aiohttp.server"):
        logging.getLogger(name).addFilter(quiet)
    return quiet


def fit_to_fd_limit(max_connections: int) -> int:
    """``max_connections``, after raising the descriptor limit toward what it needs; lowered
    (with a warning) when the hard limit is too low for it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fitted = max(1, soft - FD_RESERVE)
        logger.warning(
            "max_connections=%d needs %d file descriptors but the limit is %d; using %d",
            max_connections,
            need,
            soft,
            fitted,
        )
        return fitted
    return max_connections


_BUSY = json.dumps(
    {
        "error": {
            "message": "too many connections",
            "type": "service_unavailable",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY
)


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_BUSY_RESPONSE)
        transport.close()


class ConnectionCap:
    """The listener's protocol factory: aiohttp's handler while under ``limit`` connections."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self.server = server
        self.limit = limit
        self.refused = 0
        self._pending = 0  # handlers made whose connection_made has not run yet
        self._log = RateLimit()

    def __call__(self) -> asyncio.Protocol:
        # NOTE: asyncio accepts a burst of sockets before any connection_made runs, so the count
        # includes the handlers just made; the transport schedules connection_made right after
        # the call_soon below, so the handler moves from pending to connections in one go.
        if len(self.server.connections) + self._pending < self.limit:
            self._pending += 1
            asyncio.get_running_loop().call_soon(self._made)
            return self.server()
        self.refused += 1
        if self._log.allow() is not None:
            logger.warning(
                "%d connections open (--max-connections): refusing new ones (%d so far)",
                self.limit,
                self.refused,
            )
        return _Refuse()

    def _made(self) -> None:
        self._pending -= 1


async def listen(
    runner: web.AppRunner, host: str, port: int, max_connections: int
) -> asyncio.Server:
    """Serve ``runner``'s application on ``host:port`` with at most ``max_connections``."""
    assert runner.server is not None, "call runner.setup() first"
    cap = ConnectionCap(runner.server, fit_to_fd_limit(max_connections))
    loop = asyncio.get_running_loop()
    return await loop.create_server(cap, host, port, backlog=128, reuse_address=True)
