"""The one guard every graph runner has, and the one way it counts.

A graph runner (piecewise, extend, decode, verify, draft) serves a batch only where
``can_run(batch)`` holds; that asks ``_refusal(batch)`` for a reason not to (None: it serves it),
and a refusal is counted under its reason before the caller runs the batch another way (eagerly,
or the piecewise runner after the extend or decode graphs). ``stats()`` has one shape for every
runner; the engine reports it per runner (``Engine.graph_stats``), and the server exports it in
/server_info and /metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, TypedDict


class GraphStats(TypedDict):
    graphs: int  # batch sizes or token buckets captured (0 where nothing is)
    runs: int  # batches served (replays; on CPU, runs of the stand-in)
    padded_rows: int  # token rows served that no request owned (padding to a bucket)
    fallbacks: dict[str, int]  # refusals by reason, every known reason from 0


class GuardedRunner(ABC):
    """Subclasses list every reason ``_refusal`` may return in ``reasons``, count what they
    serve with ``_count_run`` and say how many graphs they hold in ``num_graphs``.
    """

    reasons: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._runs = 0
        self._padded_rows = 0
        self._fallbacks: Counter[str] = Counter(dict.fromkeys(self.reasons, 0))

    def can_run(self, batch: Any) -> bool:
        """Whether the runner serves ``batch``; a refusal is counted by reason (ask once per
        pass: every refusal is a pass run another way).
        """
        reason = self._refusal(batch)
        if reason is None:
            return True
        if reason not in self._fallbacks:
            raise RuntimeError(
                f"{type(self).__name__} refused for {reason!r}, not one of "
                f"its reasons {self.reasons}"
            )
        self._fallbacks[reason] += 1
        return False

    @abstractmethod
    def _refusal(self, batch: Any) -> str | None:
        """Why the runner cannot serve ``batch`` (one of ``reasons``), or None."""

    @property
    @abstractmethod
    def num_graphs(self) -> int: ...

    @property
    def runs(self) -> int:
        """Batches served so far."""
        return self._runs

    def _count_run(self, padded_rows: int = 0) -> None:
        self._runs += 1
        self._padded_rows += padded_rows

    def stats(self) -> GraphStats:
        return GraphStats(
            graphs=self.num_graphs,
            runs=self._runs,
            padded_rows=self._padded_rows,
            fallbacks=dict(self._fallbacks),
        )


def prefill_input_refusal(batch: Any, hidden_mode: Any) -> str | None:
    """What a runner of the traced decoder refuses in a prefill-like batch (piecewise pieces,
    extend graphs): hidden states captured in another mode than the trace's
    (``hidden_mode``), input embeddings instead of token ids, the prompt's own logprobs."""
    if batch.capture_hidden_mode is not hidden_mode:
        return "hidden_mode"
    if batch.input_embeds is not None:
        return "input_embeds"
    if batch.return_input_logprobs:
        return "input_logprobs"
    return None


def hit_ratio(stats: GraphStats) -> float | None:
    """Runs / batches offered (runs + fallbacks); None before the first offer."""
    offered = stats["runs"] + sum(stats["fallbacks"].values())
    return stats["runs"] / offered if offered else None
