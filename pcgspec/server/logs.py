"""What the server logs at info level, as vLLM does: one line per finished request (server
process), and the throughput line (engine loop): every ``interval`` seconds while the engine
has requests, running / waiting sequences, prompt and generation tokens per second and KV-cache
usage; a busy spell that logged one ends with a last line for its rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pcgspec.server.async_engine import RequestStream

logger = logging.getLogger("pcgspec")
THROUGHPUT_LOG_INTERVAL = 10.0  # seconds
IDLE_GAP = 1.0  # seconds without a step: the engine was idle


def log_finished(stream: RequestStream, now: float, error: BaseException | None) -> None:
    """One line for a request that ended (its ``n`` sequences), ``now`` on its arrival's clock."""
    if not logger.isEnabledFor(logging.INFO):
        return
    reason = (
        f"error: {error}"
        if error is not None
        else ",".join(dict.fromkeys(stream.finish_reasons)) or "none"
    )
    logger.info(
        "request %s finished (%s): %d prompt tokens, %d output tokens, %.0f ms",
        stream.request_id,
        reason,
        stream.num_prompt_tokens,
        stream.num_output_tokens,
        1e3 * (now - stream.arrival),
    )


class ThroughputLog:
    """Engine thread only: ``begin`` before each step, ``count`` the tokens each publish
    carries, ``tick`` after the step."""

    def __init__(
        self,
        interval: float = THROUGHPUT_LOG_INTERVAL,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._start: float | None = None  # the window's; None while idle
        self._last_tick = 0.0
        self._logged = False  # a line of this busy spell was logged
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def begin(self) -> None:
        """A step starts. A busy loop steps again at once: after a pause (the engine was idle,
        its requests ended by aborts) a new spell begins."""
        now = self._clock()
        if self._start is None or now - self._last_tick > IDLE_GAP:
            self._open(now, logged=False)

    def count(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Tokens a publish's deltas carry: the caller counts a sequence's prompt with its
        first token (its prefill is done), as vLLM counts it."""
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens

    def tick(self, busy: bool, stats: Callable[[], dict[str, int]]) -> None:
        """After a step: log when the window is ``interval`` old, or when a spell that logged
        ends (``busy`` False); ``stats`` is ``Engine.stats``, read only to log."""
        now = self._last_tick = self._clock()
        if self._start is None:
            return
        elapsed = now - self._start
        if elapsed >= self.interval or (not busy and self._logged and elapsed > 0):
            if logger.isEnabledFor(logging.INFO):
                logger.info(self._line(elapsed, stats()))
            self._open(now, logged=True)
        if not busy:
            self._start = None

    def _open(self, now: float, logged: bool) -> None:
        self._start, self._logged = now, logged
        self._prompt_tokens = self._generation_tokens = 0

    def _line(self, elapsed: float, stats: dict[str, int]) -> str:
        used, total = stats["kv_pages_used"], stats["kv_pages_total"]
        return (
            f"running {stats['num_running']}, waiting {stats['num_waiting']} | "
            f"prompt {self._prompt_tokens / elapsed:.1f} tok/s, generation "
            f"{self._generation_tokens / elapsed:.1f} tok/s | KV cache "
            f"{100 * used / max(total, 1):.1f}% ({used}/{total} pages)"
        )
