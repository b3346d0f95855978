"""The synchronous ``Engine`` on a thread of its own, requests as asyncio streams.

The engine thread builds the ``Engine`` and steps it; the event loop reaches it only through a
command queue (add, abort, flush, stop) and gets each step's deltas back through
``loop.call_soon_threadsafe``. So blocking torch work never stalls the loop, and ``Request``
objects are touched by one thread only. An abort takes effect between two steps: the sequence
finishes with "abort" and its KV pages return to the pool at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pcgspec.config import EngineConfig
from pcgspec.engine.engine import Engine
from pcgspec.sampling_params import SamplingParams
from pcgspec.server.deltas import SeqDelta, SeqTracker

if TYPE_CHECKING:
    from pcgspec.server.metrics import ServerMetrics

logger = logging.getLogger("pcgspec")


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, or died of an error)."""


class RequestFailedError(EngineDeadError):
    """A step failed on this request's data; it alone ends (the engine serves on). A subclass
    so that every handler of an engine failure answers it the same way (500 internal_error)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters as of the end of the last step (swapped in whole, read lock-free)."""

    stats: dict[str, int] = field(default_factory=dict)  # Engine.stats()
    spec: dict[str, Any] = field(default_factory=dict)  # Engine.spec_stats()
    piecewise: dict[str, int] = field(default_factory=dict)  # runs and fallbacks by reason
    cache: dict[str, float] = field(default_factory=dict)  # Engine.cache_stats()
    decode_graphs: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    num_aborted: int = 0  # requests (groups of n) aborted
    num_step_errors: int = 0


class RequestStream:
    """One engine request (one prompt, ``n`` sequences), seen from the event loop."""

    def __init__(
        self, request_id: str, prompt_index: int, num_prompt_tokens: int, out: asyncio.Queue[Any]
    ) -> None:
        self.request_id = request_id
        self.prompt_index = prompt_index
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0  # of the prompt, served by the prefix cache
        self.out = out
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.finish_reasons: list[str] = []
        self.finished = False

    def settle(self, error: BaseException | None) -> None:
        _settle_future(self.accepted, error)


class Generation:
    """The engine requests of one HTTP request, merged into one stream of deltas."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.streams: list[RequestStream] = []

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue one prompt; raises the engine's ``ValueError`` if it refuses it."""
        stream = RequestStream(request_id, len(self.streams), len(prompt_ids), self.queue)
        self.streams.append(stream)
        self.engine.submit(stream, prompt_ids, params)
        await stream.accepted

    async def updates(self) -> AsyncIterator[tuple[RequestStream, list[SeqDelta]]]:
        """Deltas as they come, until every sequence finished; an engine error raises."""
        remaining = len(self.streams)
        while remaining:
            stream, item, final = await self.queue.get()
            if isinstance(item, RequestFailedError):
                raise item
            if isinstance(item, BaseException):
                raise EngineDeadError(f"the engine failed: {item}") from item
            remaining -= final
            yield stream, item

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)


class AsyncEngine:
    def __init__(self, metrics: ServerMetrics | None = None) -> None:
        self.metrics = metrics
        self.engine: Engine | None = None
        self.snapshot = EngineSnapshot()
        self.streams: dict[str, RequestStream] = {}  # loop side: unfinished requests
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, tuple[RequestStream, list[SeqTracker]]] = {}  # engine thread
        self._counts = {"num_steps": 0, "num_aborted": 0, "num_step_errors": 0}

    # Event-loop side --------------------------------------------------------------------------

    async def start(self, config: EngineConfig) -> Engine:
        """Build the engine on its thread and start stepping; returns once it is ready."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(config, ready), name="pcgspec-engine", daemon=True
        )
        self._thread.start()
        await ready
        assert self.engine is not None
        return self.engine

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.engine is not None

    def submit(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams) -> None:
        if not self.alive:
            stream.settle(EngineDeadError("the engine loop is not running"))
            return
        self.streams[stream.request_id] = stream
        self._send("add", (stream, prompt_ids, params))

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def abort_all(self) -> None:
        for request_id in list(self.streams):
            self.abort(request_id)

    async def flush_cache(self) -> None:
        """Drop every cached prefix, on the engine thread between two steps."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        self._send("flush", done)
        await done

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping after the current step (unfinished requests are left as they are)."""
        self._send("stop", None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _deliver(self, batch: list[tuple[RequestStream, Any, bool]]) -> None:
        now = time.perf_counter()
        for stream, item, final in batch:
            if final:
                stream.finished = True
                self.streams.pop(stream.request_id, None)
            if not isinstance(item, BaseException):
                if self.metrics is not None:
                    self.metrics.observe(stream, item, final, now)
                _record(stream, item, now)
            stream.out.put_nowait((stream, item, final))

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # Engine-thread side -----------------------------------------------------------------------

    def _main(self, config: EngineConfig, ready: asyncio.Future[None]) -> None:
        try:
            engine = Engine(config)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of start()
            self._call(_settle_future, ready, e)
            return
        self.engine = engine
        self._publish()
        self._call(_settle_future, ready, None)
        try:
            self._run()
        except BaseException as e:
            logger.exception("the engine loop died")
            self._fail_all(e)
            self.engine = None

    def _run(self) -> None:
        engine = self.engine
        assert engine is not None
        while self._run_commands():
            if engine.has_unfinished:
                self._step(engine)
            else:
                self._wake.wait()
                self._wake.clear()

    def _run_commands(self) -> bool:
        """Apply queued commands; False once asked to stop."""
        ran = False
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "stop":
                return False
            ran = True
            if kind == "add":
                self._add(*payload)
            elif kind == "abort" and self.engine is not None and self.engine.abort(payload):
                self._counts["num_aborted"] += 1
            elif kind == "flush" and self.engine is not None:
                self.engine.flush_cache()
                self._call(_settle_future, payload, None)
        if ran:
            self._publish()
        return True

    def _add(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams) -> None:
        assert self.engine is not None
        try:
            reqs = self.engine.add_request(prompt_ids, params, request_id=stream.request_id)
        except ValueError as e:
            self._call(_reject, self, stream, e)
            return
        self._live[stream.request_id] = (stream, [SeqTracker(r) for r in reqs])
        self._call(stream.settle, None)

    def _step(self, engine: Engine) -> None:
        try:
            engine.step()
            self._counts["num_steps"] += 1
        except Exception as e:
            # NOTE: no request is to blame for sure: abort all (frees their pages), keep serving.
            logger.exception("engine step failed; aborting %d requests", len(self._live))
            self._counts["num_step_errors"] += 1
            for request_id in list(self._live):
                engine.abort(request_id)
            self._fail_all(e)
        self._publish()

    def _publish(self) -> None:
        """Hand every new delta to the loop in one call, and refresh the snapshot."""
        batch: list[tuple[RequestStream, Any, bool]] = []
        for request_id, (stream, trackers) in list(self._live.items()):
            error = self._failure(request_id, trackers)
            if error is not None:
                del self._live[request_id]
                batch.append((stream, error, True))
                continue
            deltas = [d for d in (t.delta() for t in trackers) if d is not None]
            if not deltas:
                continue
            final = all(t.done for t in trackers)
            if final:
                del self._live[request_id]
            batch.append((stream, deltas, final))
        self.snapshot = self._take_snapshot()
        if batch:
            self._call(self._deliver, batch)

    def _failure(self, request_id: str, trackers: list[SeqTracker]) -> RequestFailedError | None:
        """The error of a request one of whose sequences a step failed on (the others are
        aborted), or None."""
        failed = next((t.req for t in trackers if t.req.finish_reason == "error"), None)
        if failed is None:
            return None
        if self.engine is not None:
            self.engine.abort(request_id)
        return RequestFailedError(f"the request failed: {failed.error}")

    def _fail_all(self, error: BaseException) -> None:
        batch = [(stream, error, True) for stream, _ in self._live.values()]
        self._live.clear()
        if batch:
            self._call(self._deliver, batch)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        if engine is None:
            return self.snapshot
        runner = engine.runner
        return EngineSnapshot(
            stats=engine.stats(),
            spec=engine.spec_stats(),
            cache=engine.cache_stats(),
            piecewise=runner.piecewise.stats() if runner.piecewise is not None else {},
            decode_graphs=runner.decode_graphs.stats() if runner.decode_graphs is not None else {},
            **self._counts,
        )


def _record(stream: RequestStream, deltas: Sequence[SeqDelta], now: float) -> None:
    tokens = sum(len(d.token_ids) for d in deltas)
    if tokens:
        if stream.first_token_time is None:
            stream.first_token_time = now
        stream.last_token_time = now
        stream.num_output_tokens += tokens
    stream.finish_reasons += [d.finish_reason for d in deltas if d.finish_reason is not None]
    for d in deltas:
        if d.index == 0:  # NOTE: the prompt's first sequence; the others hit its pages (n > 1)
            stream.num_cached_tokens = d.num_cached_tokens


def _settle_future(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _reject(engine: AsyncEngine, stream: RequestStream, error: BaseException) -> None:
    engine.streams.pop(stream.request_id, None)
    stream.finished = True
    stream.settle(error)
