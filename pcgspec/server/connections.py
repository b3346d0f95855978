"""Quiet logs and the descriptor limit: no client can exhaust file descriptors or fill the log.

The log lines a client can trigger at will are rate-limited and lose their tracebacks; who gets
a connection is ``admission``'s business.
"""

from __future__ import annotations

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
