"""Rank 0's side of tensor parallelism: start or join the other ranks, send each forward's
batch, and fail fast and clean when any rank dies.

Two ways to start the workers, one worker loop (``runners/tp_worker.py``):
- by itself (one host): ``torch.multiprocessing`` spawn children running the entry point rank
  0's runner hands in; each builds its own ``ModelRunner`` on its shard and device, then
  replays rank 0's forwards. They leave when rank 0 stops them, when rank 0 dies (they watch
  its process), or on a signal. When a worker dies, rank 0's next forward raises (a dead
  peer's collective fails on gloo; on CUDA a watcher thread aborts the groups so a blocked
  NCCL call returns) and the group is torn down;
- under ``torchrun`` (one host or several): every process of the job is a rank (``env://``);
  rank 0 runs the engine and the others the worker loop (``serve_if_torchrun_worker``), and
  torchrun owns their lives: a rank that dies fails the job's collectives, and torchrun's
  agents stop the rest.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from pcgspec.distributed.broadcast import StepChannel, StepMessage
from pcgspec.distributed.group import TPGroup
from pcgspec.distributed.process_group import (
    Rendezvous,
    TPProcessGroups,
    disable_nvlink_multicast,
)
from pcgspec.envs import torchrun_env
from pcgspec.models.loader import load_config
from pcgspec.models.random_weights import RandomWeights, shape_config
from pcgspec.models.registry import model_class

if TYPE_CHECKING:
    from pcgspec.config import EngineConfig

logger = logging.getLogger("pcgspec")
JOIN_TIMEOUT_S = 10.0
# a worker's entry point: (config, model_path, rendezvous, rank), importable by the spawn child
WorkerMain = Callable[["EngineConfig", "Path | RandomWeights | None", Rendezvous, int], None]


class TPGroupFailed(RuntimeError):
    """A rank of the tensor-parallel group died or failed; the engine cannot go on."""


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """A rank's device: on CUDA ``cuda:(first + local_rank)`` (first: the config's index), else
    the config's device.
    """
    device = config.torch_device
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


class TPDriver:
    """Rank 0's end of the group: joins torchrun's job when started by it, else spawns a
    process per other rank running ``worker``.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path | RandomWeights | None,
        worker: WorkerMain,
        setup: object,
    ) -> None:
        """``setup``: what every worker receives first, once the group has formed (how to build
        its runner)."""
        check_shardable(model_path, config.tp_size)
        disable_nvlink_multicast()  # NOTE: before the spawn: children inherit the environment
        self.torchrun = torchrun_env()
        rendezvous, local_rank = self._start(config, model_path, worker)
        # NOTE: at garbage collection or interpreter exit: terminate at once (nothing to flush)
        self._stopping = threading.Event()  # set before any intended exit: the watcher ignores it
        self._finalizer = weakref.finalize(self, _stop, list(self.procs), self._stopping)
        self._lock = threading.Lock()  # NOTE: one thread at a time polls and reaps the workers
        self.failure: str | None = None
        try:
            self.groups = TPProcessGroups(rendezvous, 0, rank_device(config, local_rank))
            self.groups.from_rank0(setup)
        except BaseException:
            self._finalizer()
            raise
        self.channel = StepChannel(self.groups)
        if self.torchrun is not None:  # NOTE: at exit torchrun's workers are told to leave
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _tell_stop, self.channel, self._stopping)
        if self.procs:
            threading.Thread(target=self._watch, name="pcgspec-tp-watch", daemon=True).start()
        logger.info(
            "tensor parallel: %d ranks (%s), %s",
            config.tp_size,
            "nccl" if self.groups.device.type == "cuda" else "gloo",
            f"workers {[p.pid for p in self.procs]}" if self.procs else "started by torchrun",
        )

    def _start(
        self, config: EngineConfig, model_path: Path | RandomWeights | None, worker: WorkerMain
    ) -> tuple[Rendezvous, int]:
        """Spawn the workers (``procs``), or under torchrun find the job's; this rank's
        rendezvous and local rank.
        """
        env = self.torchrun
        if env is None:
            rendezvous = Rendezvous.local(config.tp_size)
            self.procs = _spawn(worker, config, model_path, rendezvous)
            return rendezvous, 0
        if env.rank != 0:
            raise RuntimeError(
                f"torchrun rank {env.rank} builds an engine: ranks other than 0 run the worker "
                "loop (pcgspec.runners.tp_worker.serve_if_torchrun_worker)"
            )
        self.procs: list[BaseProcess] = []
        return Rendezvous.from_env(env), env.local_rank

    @property
    def tp(self) -> TPGroup:
        return self.groups.tp

    @contextmanager
    def step(self, message: StepMessage) -> Iterator[None]:
        """Broadcast ``message`` (a ``ForwardBatch``'s, or a K/V move's), then run rank 0's part
        in the block. Any failure, here or in the block, ends the group: the ranks' collectives
        can no longer be matched.
        """
        self._check()
        try:
            self.channel.send(message)
            yield
        except BaseException as error:
            self._fail(f"forward failed on rank 0 or a peer: {type(error).__name__}: {error}")
            self._check()
            raise

    def shutdown(self) -> None:
        """Stop the workers: a stop message when healthy and a short wait for them to leave,
        then terminate (and kill) whatever is left.
        """
        with self._lock:
            self._stopping.set()
            if self.failure is None and all(p.is_alive() for p in self.procs):
                try:
                    self.channel.stop()
                    for proc in self.procs:
                        proc.join(JOIN_TIMEOUT_S)
                except Exception:  # NOTE: a worker died meanwhile: _stop below handles it
                    logger.warning("tensor parallel: stop message failed", exc_info=True)
            self.failure = self.failure or "shut down"
            self._finalizer()
        self.groups.destroy()

    def _check(self) -> None:
        with self._lock:
            dead = [(p.name, p.exitcode) for p in self.procs if p.exitcode is not None]
        if dead:
            self._fail(f"worker exited: {dead} (name, exit code)")
        if self.failure is not None:
            raise TPGroupFailed(f"tensor-parallel group is down: {self.failure}")

    def _fail(self, reason: str) -> None:
        self._stopping.set()
        with self._lock:
            if self.failure is None:
                self.failure = reason
                logger.error("tensor parallel: %s; stopping every worker", reason)
            self._finalizer()  # NOTE: survivors may wait in a collective: no graceful join

    def _watch(self) -> None:
        """Wake on the first worker exit; on CUDA abort the groups so a blocked NCCL call on
        rank 0 raises instead of waiting for its timeout.
        """
        wait([p.sentinel for p in self.procs])
        if self._stopping.is_set() or self.failure is not None:
            return
        self._fail(f"a worker exited ({', '.join(p.name for p in self.procs)})")
        self.groups.abort()


def check_shardable(model_path: Path | RandomWeights | None, tp_size: int) -> None:
    """Build the model as rank 0 of ``tp_size`` on the meta device: a head count or size that
    does not divide raises its ``ValueError`` here, before any process starts.
    """
    if isinstance(model_path, RandomWeights):
        hf_config = shape_config(model_path.shape)
    else:
        hf_config = load_config(model_path)
    with torch.device("meta"):
        model_class(hf_config)(hf_config, TPGroup(0, tp_size, "meta"))


def _spawn(
    worker: WorkerMain,
    config: EngineConfig,
    model_path: Path | RandomWeights | None,
    rendezvous: Rendezvous,
) -> list[BaseProcess]:
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    for rank in range(1, config.tp_size):
        proc = ctx.Process(
            target=worker,
            name=f"pcgspec-tp{rank}",
            daemon=True,
            args=(config, model_path, rendezvous, rank),
        )
        proc.start()
        procs.append(proc)
    return procs


def _tell_stop(channel: StepChannel, stopping: threading.Event) -> None:
    """torchrun: the stop message, unless the group already stopped or failed."""
    if stopping.is_set():
        return
    stopping.set()
    try:
        channel.stop()
    except Exception:  # NOTE: at exit, a peer already gone: torchrun reports it
        logger.warning("tensor parallel: stop message failed", exc_info=True)


def _stop(procs: list[BaseProcess], stopping: threading.Event) -> None:
    """Terminate the workers still running, then kill those that ignore it."""
    stopping.set()
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
