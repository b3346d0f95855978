"""The server's end of the engine: requests as asyncio streams, the engine loop
(engine_loop.py) in a process of its own (or, with ``--engine-in-process``, on a thread).

The event loop reaches the engine only through commands (add, abort, flush, stop); the engine's
messages (each step's deltas, counter snapshots, replies) come back to the event loop, from a
reader thread of the process's pipe or from the engine thread, through
``loop.call_soon_threadsafe``. An abort takes effect between two steps: the sequence finishes
with "abort" and its KV pages return to the pool at once. When the engine process exits or its
loop dies, every open request ends with ``EngineDeadError`` and ``alive`` turns False.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pcgspec.config import EngineConfig
from pcgspec.sampling_params import SamplingParams
from pcgspec.server.deltas import SeqDelta, from_wire_form
from pcgspec.server.engine_loop import (
    EngineDeadError,
    EngineInfo,
    EngineSnapshot,
    RequestFailedError,
    ThreadChannel,
    run_engine,
    run_engine_process,
)
from pcgspec.server.logs import log_finished

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pcgspec.server.metrics import ServerMetrics

logger = logging.getLogger("pcgspec")
__all__ = ["AsyncEngine", "EngineDeadError", "EngineSnapshot", "Generation", "RequestFailedError"]


class RequestStream:
    """One engine request (one prompt, ``n`` sequences), seen from the event loop."""

    def __init__(
        self,
        request_id: str,
        prompt_index: int,
        num_prompt_tokens: int,
        out: asyncio.Queue[Any],
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.prompt_index = prompt_index
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0  # of the prompt, served by the prefix cache
        self.out = out
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.arrival = arrival  # the HTTP request's, before its body was read
        self.submitted: float | None = None  # handed to the engine
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.finish_reasons: list[str] = []
        self.finished = False

    def settle(self, error: BaseException | None) -> None:
        _settle_future(self.accepted, error)


class Generation:
    """The engine requests of one HTTP request, merged into one stream of deltas."""

    def __init__(self, engine: AsyncEngine, arrival: float | None = None) -> None:
        self.engine = engine
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.streams: list[RequestStream] = []
        self._remaining = 0  # streams whose final delta has not been taken

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue one prompt; raises the engine's ``ValueError`` if it refuses it."""
        stream = RequestStream(
            request_id, len(self.streams), len(prompt_ids), self.queue, self.arrival
        )
        self.streams.append(stream)
        self._remaining += 1
        self.engine.submit(stream, prompt_ids, params)
        await stream.accepted

    async def updates(self) -> AsyncIterator[list[tuple[RequestStream, list[SeqDelta]]]]:
        """Deltas as they come, until every sequence finished (then ``done``): each time all
        that is queued, so a consumer that fell behind (an event loop busy with many streams)
        takes the steps that piled up at once and writes them in one go, as vLLM's output
        collector merges them. An engine error raises after the deltas queued before it."""
        while not self.done:
            batch: list[tuple[RequestStream, list[SeqDelta]]] = []
            stream, item, final = await self.queue.get()
            while True:
                if isinstance(item, BaseException):  # an EngineDeadError (RequestFailedError)
                    if batch:
                        yield batch
                    raise item
                self._remaining -= final
                batch.append((stream, item))
                if self.done or self.queue.empty():
                    break
                stream, item, final = self.queue.get_nowait()
            yield batch

    @property
    def done(self) -> bool:
        """Every sequence finished (the last batch of ``updates`` is out)."""
        return self._remaining == 0

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)


class AsyncEngine:
    def __init__(self, metrics: ServerMetrics | None = None, in_process: bool = False) -> None:
        self.metrics = metrics
        self.in_process = in_process
        self.info: EngineInfo | None = None  # once started
        self.snapshot = EngineSnapshot()
        self.streams: dict[str, RequestStream] = {}  # unfinished requests
        self._accepting: dict[str, RequestStream] = {}  # added, not yet accepted or refused
        self._flushes: dict[int, asyncio.Future[None]] = {}
        self._tokens = itertools.count()
        self._send: Callable[[Any], None] | None = None
        self._worker: threading.Thread | multiprocessing.process.BaseProcess | None = None
        self._ready: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead = False
        self._stopping = False

    async def start(self, config: EngineConfig) -> EngineInfo:
        """Start the engine loop; returns once the engine is built (or raises its error)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        if self.in_process:
            channel = ThreadChannel(self._post)
            self._send = channel.inbox.put
            self._worker = threading.Thread(
                target=run_engine, args=(config, channel), name="pcgspec-engine", daemon=True
            )
        else:
            context = multiprocessing.get_context("spawn")  # NOTE: a forked CUDA process breaks
            ours, theirs = context.Pipe()
            self._send = ours.send
            # NOTE: not a daemon: daemonic processes may not start children (tensor-parallel
            # workers). It leaves on "stop", when its pipe closes with this process, or at this
            # process's exit (``_terminate``), which would otherwise wait for it.
            self._worker = context.Process(
                target=run_engine_process,
                name="pcgspec-engine",
                args=(config, theirs, logging.getLogger().getEffectiveLevel()),
            )
        self._worker.start()
        if not self.in_process:
            atexit.register(_terminate, self._worker)
            theirs.close()  # NOTE: the reader then sees EOF once the engine process is gone
            threading.Thread(
                target=self._read, args=(ours,), name="pcgspec-engine-reader", daemon=True
            ).start()
        await self._ready
        assert self.info is not None
        return self.info

    @property
    def alive(self) -> bool:
        return (
            self.info is not None
            and not self._dead
            and self._worker is not None
            and self._worker.is_alive()
        )

    def submit(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams) -> None:
        if not self.alive:
            stream.settle(EngineDeadError("the engine loop is not running"))
            return
        self.streams[stream.request_id] = stream
        self._accepting[stream.request_id] = stream
        stream.submitted = time.perf_counter()
        self._command("add", stream.request_id, prompt_ids, params)

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id)

    def abort_all(self) -> None:
        for request_id in list(self.streams):
            self.abort(request_id)

    async def flush_cache(self) -> None:
        """Drop every cached prefix, on the engine's side between two steps."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        assert self._loop is not None
        token = next(self._tokens)
        done = self._flushes[token] = self._loop.create_future()
        self._command("flush", token)
        await done

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping after the current step (unfinished requests are left as they are)."""
        worker = self._worker
        if worker is None:
            return
        self._stopping = True
        self._command("stop")
        await asyncio.get_running_loop().run_in_executor(None, worker.join, timeout)
        if isinstance(worker, multiprocessing.process.BaseProcess) and worker.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating it", timeout)
            worker.terminate()

    def _command(self, *command: Any) -> None:
        if self._send is None or self._dead:
            return
        try:
            self._send(command)
        except (OSError, ValueError):  # NOTE: the pipe is closed: the engine process is gone
            self._died(exit_reason(self._worker, wait=0.5))

    # Messages from the engine (on the event loop) -----------------------------------------------

    def _read(self, connection: Connection) -> None:
        """Reader thread: hand every message of the engine process to the event loop."""
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                self._post(("died", exit_reason(self._worker, wait=5.0)))
                return
            self._post(message)

    def _post(self, message: tuple[Any, ...]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._handle, message)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, *payload = message
        if kind == "deltas":
            accepted, items, snapshot = payload
            for request_id in accepted:
                if (stream := self._accepting.pop(request_id, None)) is not None:
                    stream.settle(None)
            if snapshot is not None:
                self.snapshot = snapshot
            self._deliver(items)
        elif kind == "refused":
            request_id, error = payload
            if (stream := self._accepting.pop(request_id, None)) is not None:
                self.streams.pop(request_id, None)
                stream.finished = True
                stream.settle(error)
        elif kind == "flushed" and payload[0] in self._flushes:
            _settle_future(self._flushes.pop(payload[0]), None)
        elif kind == "ready":
            self.info = payload[0]
            _settle_future(self._ready, None)
        elif kind == "failed":
            self._dead = True
            _settle_future(self._ready, payload[0])
        elif kind == "died":
            self._died(payload[0])

    def _deliver(self, items: list[tuple[str, Any, bool]]) -> None:
        now = time.perf_counter()
        for request_id, item, final in items:
            stream = self.streams.get(request_id)
            if stream is None:
                continue
            if final:
                stream.finished = True
                del self.streams[request_id]
            error = item if isinstance(item, BaseException) else None
            if error is None:
                item = from_wire_form(item)
                if self.metrics is not None:
                    self.metrics.observe(stream, item, final, now)
                _record(stream, item, now)
            if final:
                log_finished(stream, now, error)
            stream.out.put_nowait((stream, item, final))

    def _died(self, message: str) -> None:
        """The engine is gone: every open request ends with ``EngineDeadError``."""
        if self._dead:
            return
        self._dead = True
        if not self._stopping:
            logger.error("%s", message)
        error = EngineDeadError(message)
        if self._ready is not None:
            _settle_future(self._ready, error)
        for stream in self._accepting.values():
            stream.settle(error)
        self._accepting.clear()
        for future in self._flushes.values():
            _settle_future(future, error)
        self._flushes.clear()
        self._deliver([(request_id, error, True) for request_id in list(self.streams)])


def exit_reason(worker: object, wait: float) -> str:
    """How the engine process ended: its exit code, or the signal that killed it."""
    if not isinstance(worker, multiprocessing.process.BaseProcess):
        return "the engine loop ended"
    worker.join(wait)
    code = worker.exitcode
    if code is None:
        return "the engine process closed its pipe and does not exit"
    if code >= 0:
        return f"the engine process exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"the engine process was killed by {name}"


def _terminate(process: multiprocessing.process.BaseProcess) -> None:
    """At exit: end an engine process still running (the server failed before stopping it)."""
    if process.is_alive():
        process.terminate()
        process.join(5)


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
