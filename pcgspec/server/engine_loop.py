"""The engine side of the server: build the ``Engine``, apply commands between steps, step while
there is work, and publish each step's deltas.

By default the loop runs in a process of its own (``run_engine_process``), as SGLang's scheduler
and vLLM's engine core do: the HTTP side (parsing, JSON, one SSE chunk per stream and step) then
never competes with the engine's host work for one GIL. With 256 requests at once on the H100
(SmolLM2 shape) the server delivered 0.96x the engine's own throughput this way, and 0.38x with
the loop on a thread of the server process. ``--engine-in-process`` runs the same loop on a
thread (one process, for debuggers and profilers). ``AsyncEngine`` (async_engine.py) is the
other end.

Messages in: ``("add", request_id, prompt_ids, params)``, ``("abort", request_id)``,
``("flush", token)``, ``("stop",)``. Out: ``("ready", EngineInfo)`` or ``("failed", error)``
once; ``("refused", request_id, error)`` for an add the engine refuses, at once;
``("deltas", accepted, items, snapshot or None)`` after steps, aborts and flushes, ``accepted``
being the requests added since the last one (an add's acceptance rides the next step's
message: a pipe write that wakes the server's reader costs the engine tens of microseconds, one
per request at 16 streams of 64 tokens) and ``items`` ``(request_id, deltas (wire form) or
error, final)``, with a counter snapshot every ``SNAPSHOT_INTERVAL`` while steps run and
whenever the engine falls idle; ``("flushed", token)``; ``("died", message)`` when the loop
fails.
"""

from __future__ import annotations

import gc
import logging
import math
import pickle
import queue
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from pcgspec import envs
from pcgspec.config import EngineConfig
from pcgspec.engine.collector import freeze_start_up
from pcgspec.engine.engine import Engine
from pcgspec.engine.isolation import device_unusable
from pcgspec.runners.refusals import GraphStats
from pcgspec.server.deltas import FIRST_TOKEN, TOKEN_IDS, SeqTracker, WireDelta
from pcgspec.server.logs import ThroughputLog

logger = logging.getLogger("pcgspec")
SNAPSHOT_INTERVAL = 0.05  # seconds between counter snapshots while steps run
MAX_STEP_ERRORS = 3  # failed steps in a row that mark the engine unhealthy


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, or died of an error)."""


class RequestFailedError(EngineDeadError):
    """A step failed on this request's data; it alone ends (the engine serves on). A subclass
    so that every handler of an engine failure answers it the same way (500 internal_error)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs of the engine it does not hold."""

    model_dir: str
    vocab_size: int
    context_length: int
    kv_tokens: int  # the KV pool's capacity


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters as of one moment between steps (swapped in whole, read lock-free)."""

    stats: dict[str, int] = field(default_factory=dict)  # Engine.stats()
    spec: dict[str, Any] = field(default_factory=dict)  # Engine.spec_stats()
    cache: dict[str, float] = field(default_factory=dict)  # Engine.cache_stats()
    graphs: dict[str, GraphStats] = field(default_factory=dict)  # Engine.graph_stats()
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # Engine.step_stats()
    num_steps: int = 0
    num_aborted: int = 0  # requests (groups of n) aborted
    num_step_errors: int = 0
    unhealthy: str | None = None  # why every later step will fail too (then for good)


class Channel(Protocol):
    """The loop's end of the connection (``PipeChannel``, ``ThreadChannel``)."""

    def poll(self, timeout: float | None = 0.0) -> bool: ...
    def recv(self) -> Any: ...
    def send(self, message: Any) -> None: ...


class ThreadChannel:
    """The loop's end when it runs on a thread: commands from a queue, messages handed to
    ``deliver`` (which must be thread-safe)."""

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.send = deliver
        self._next: list[Any] = []

    def poll(self, timeout: float | None = 0.0) -> bool:
        if not self._next:
            try:
                self._next.append(self.inbox.get(timeout=timeout))  # NOTE: 0 does not wait
            except queue.Empty:
                return False
        return True

    def recv(self) -> Any:
        self.poll(None)
        return self._next.pop()


class PipeChannel:
    """The loop's end of a ``multiprocessing`` pipe, with two per-step costs cut: ``poll`` asks
    one ``select.poll`` object (``Connection.poll`` builds a selector per call) and ``send`` is
    one ``pickle.dumps`` (``Connection.send`` builds a ``ForkingPickler`` and copies its
    dispatch table per call); the server reads them with ``Connection.recv``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._poller = select.poll()
        self._poller.register(connection.fileno(), select.POLLIN)

    def poll(self, timeout: float | None = 0.0) -> bool:
        """A message (or the other end's close) is waiting; ``timeout`` None: wait for one."""
        wait_ms = None if timeout is None else math.ceil(timeout * 1000)
        return bool(self._poller.poll(wait_ms))

    def recv(self) -> Any:
        return self.connection.recv()

    def send(self, message: Any) -> None:
        self.connection.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def run_engine_process(config: EngineConfig, connection: Connection, log_level: int) -> None:
    """The engine process's entry point. Ctrl-C reaches the whole process group: the server
    process handles it and stops this one with a command."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=envs.LOG_FORMAT)
    log_slow_collections("engine")
    run_engine(config, PipeChannel(connection), freeze=True)


def log_slow_collections(process: str, threshold: float = 1e-3) -> None:
    """At debug level, log each garbage collection of this process that takes longer than
    ``threshold`` seconds (a pause of every request the process serves at that moment)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    start = 0.0

    def timed(phase: str, info: dict[str, int]) -> None:
        nonlocal start
        if phase == "start":
            start = time.perf_counter()
        elif (took := time.perf_counter() - start) > threshold:
            logger.debug(
                "%s: gc of generation %d took %.2f ms (%d collected)",
                process,
                info["generation"],
                1e3 * took,
                info["collected"],
            )

    gc.callbacks.append(timed)


def run_engine(config: EngineConfig, channel: Channel, freeze: bool = False) -> None:
    """Build the engine, announce it, serve commands until ``stop`` (or until the other end
    closes). ``freeze``: this process is the engine's own; what start-up built leaves its
    collector (``freeze_start_up``)."""
    try:
        engine = Engine(config)
    except BaseException as e:  # noqa: BLE001 - handed to the server, which raises it
        try:
            channel.send(("failed", e))
        except Exception:  # NOTE: it does not pickle
            channel.send(("failed", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    if freeze:
        freeze_start_up()
    stats = engine.stats()
    channel.send(
        (
            "ready",
            EngineInfo(
                str(engine.model_dir),
                engine.runner.vocab_size,
                engine.context_length,
                stats["kv_pages_total"] * stats["page_size"],
            ),
        )
    )
    loop = EngineLoop(engine, channel)
    try:
        loop.run()
    except (EOFError, OSError):  # the server is gone
        pass
    except BaseException as e:
        logger.exception("the engine loop died")
        loop.fail_all(EngineDeadError(f"the engine failed: {e}"))
        channel.send(("died", f"the engine loop died: {e!r}"))
    finally:
        engine.runner.shutdown()  # tensor-parallel workers leave now, not at this process's exit


class EngineLoop:
    def __init__(self, engine: Engine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self._live: dict[str, list[SeqTracker]] = {}
        self._accepted: list[str] = []  # added since the last message (``_send_deltas``)
        self._counts = {"num_steps": 0, "num_aborted": 0, "num_step_errors": 0}
        self._snapshot_time = 0.0
        self._throughput = ThroughputLog()
        self._failed_in_a_row = 0
        self._unhealthy: str | None = None

    def run(self) -> None:
        engine = self.engine
        while self._apply_commands(wait=not engine.has_unfinished):
            if engine.has_unfinished:
                self._step()

    def _apply_commands(self, wait: bool) -> bool:
        """Apply the queued commands (with ``wait``, block for the first); False once asked to
        stop."""
        timeout: float | None = None if wait else 0.0
        changed = False  # NOTE: an add changes nothing a client sees until the next step
        while self.channel.poll(timeout):
            timeout = 0.0
            kind, *payload = self.channel.recv()
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                changed = True
                if self.engine.abort(payload[0]):
                    self._counts["num_aborted"] += 1
            elif kind == "flush":
                changed = True
                self.engine.flush_cache()
                self.channel.send(("flushed", payload[0]))
        if changed or (self._accepted and not self.engine.has_unfinished):
            self._publish(snapshot=True)  # NOTE: also an add no step follows (it ended at once)
        return True

    def _add(self, request_id: str, prompt_ids: list[int], params: Any) -> None:
        try:
            reqs = self.engine.add_request(prompt_ids, params, request_id=request_id)
        except ValueError as e:
            self.channel.send(("refused", request_id, e))
            return
        self._live[request_id] = [SeqTracker(r) for r in reqs]
        self._accepted.append(request_id)
        logger.debug("added %s: %d prompt tokens", request_id, len(prompt_ids))

    def _step(self) -> None:
        engine, failed = self.engine, False
        self._throughput.begin()
        try:
            engine.step()
            self._counts["num_steps"] += 1
            self._failed_in_a_row = 0
        except Exception as e:
            # NOTE: no request is to blame for sure: abort all (frees their pages), keep serving.
            logger.exception("engine step failed; aborting %d requests", len(self._live))
            self._counts["num_step_errors"] += 1
            self._note_failure(e)
            for request_id in list(self._live):
                engine.abort(request_id)
            self.fail_all(EngineDeadError(f"the engine failed: {e}"))
            failed = True
        self._publish(snapshot=failed)
        self._throughput.tick(engine.has_unfinished, engine.stats)

    def _note_failure(self, error: Exception) -> None:
        """A step raised. The engine is unhealthy for good (``/health`` answers 503, as SGLang's
        does once its scheduler cannot step) when every later step will meet the failure too:
        at once for an error that marks the device unusable (a sticky CUDA error), else after
        ``MAX_STEP_ERRORS`` failed steps in a row. A transient failure leaves it healthy.
        """
        self._failed_in_a_row += 1
        if self._unhealthy is not None:
            return
        if device_unusable(error) or self._failed_in_a_row >= MAX_STEP_ERRORS:
            self._unhealthy = (
                f"{self._failed_in_a_row} engine step(s) failed in a row, the "
                f"last with {type(error).__name__}: {error}"
            )
            logger.error("the engine is unhealthy: %s", self._unhealthy)

    def _publish(self, snapshot: bool) -> None:
        """Send every new delta in one message, with the counters when asked, when a request
        failed, when the engine is left idle, or when the last snapshot is ``SNAPSHOT_INTERVAL``
        old (not at every finish: at 16 streams one ends every few steps, and a snapshot costs
        about as much as publishing a step's deltas)."""
        items: list[tuple[str, Any, bool]] = []
        prompt_tokens = generated = 0
        for request_id, trackers in list(self._live.items()):
            deltas: list[WireDelta] = []
            failed: SeqTracker | None = None
            final = True  # NOTE: decided in the same pass (no all() generator): per stream and step
            for tracker in trackers:
                if tracker.req.finish_reason == "error":  # a step failed on this sequence
                    failed = tracker
                    break
                if (d := tracker.delta()) is not None:
                    deltas.append(d)
                final = final and tracker.done
            if failed is not None:
                self.engine.abort(request_id)  # NOTE: its other sequences end with it
                del self._live[request_id]
                error = RequestFailedError(f"the request failed: {failed.req.error}")
                items.append((request_id, error, True))
                snapshot = True
                continue
            if not deltas:
                continue
            for d in deltas:
                generated += len(d[TOKEN_IDS])
                if d[FIRST_TOKEN] is not None:  # its prefill is done: its prompt counts
                    prompt_tokens += trackers[0].req.prompt_len
            if final:
                del self._live[request_id]
            items.append((request_id, deltas, final))
        self._throughput.count(prompt_tokens, generated)
        now = time.perf_counter()
        if (
            snapshot
            or not self.engine.has_unfinished
            or now - self._snapshot_time > SNAPSHOT_INTERVAL
        ):
            self._snapshot_time = now
            self._send_deltas(items, self._snapshot())
        elif items or self._accepted:
            self._send_deltas(items, None)

    def fail_all(self, error: EngineDeadError) -> None:
        items = [(request_id, error, True) for request_id in self._live]
        self._live.clear()
        if items or self._accepted:
            self._send_deltas(items, self._snapshot())

    def _send_deltas(
        self, items: list[tuple[str, Any, bool]], snapshot: EngineSnapshot | None
    ) -> None:
        accepted, self._accepted = self._accepted, []
        self.channel.send(("deltas", accepted, items, snapshot))

    def _snapshot(self) -> EngineSnapshot:
        engine = self.engine
        return EngineSnapshot(
            stats=engine.stats(),
            spec=engine.spec_stats(),
            cache=engine.cache_stats(),
            graphs=engine.graph_stats(),
            steps=engine.step_stats(),
            unhealthy=self._unhealthy,
            **self._counts,
        )
