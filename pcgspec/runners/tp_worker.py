"""A tensor-parallel worker: its shard of the model, then rank 0's forwards, replayed.

One loop (``serve_steps``), two ways in: ``run_worker``, the entry point rank 0's
``TPDriver`` spawns (one host), and ``serve_if_torchrun_worker``, which ``LLM`` and
``pcgspec serve`` call first so that every torchrun rank but 0 becomes a worker (one host or
several). distributed/ runs a runner without importing runners/.

The worker never samples: rank 0 samples alone and the chosen tokens reach the workers as the
next step's ``input_ids``, so every rank computes on the same tokens by construction.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING

from pcgspec.distributed.broadcast import StepChannel
from pcgspec.distributed.launcher import rank_device
from pcgspec.distributed.process_group import Rendezvous, TPProcessGroups
from pcgspec.envs import torchrun_env
from pcgspec.kernels.warmup import AttentionShape, KernelWarmup, warm_up_kernels
from pcgspec.runners.batch_wire import from_message, is_kv_move, kv_move_from_message
from pcgspec.runners.model_runner import ModelRunner

if TYPE_CHECKING:
    from pcgspec.config import EngineConfig
    from pcgspec.models.random_weights import RandomWeights

logger = logging.getLogger("pcgspec")


@dataclass(frozen=True)
class WorkerSetup:
    """Rank 0's runner arguments, sent to every worker once the group forms: its config (the
    auxiliary hidden layers a draft head set included) and what the drafter needs, so that
    every rank traces and captures the same graphs however it was started.
    """

    config: EngineConfig
    draft_kv_bytes_per_token: int
    drafter_reads_hidden: bool


def run_worker(
    config: EngineConfig, model_path: Path | RandomWeights | None, rendezvous: Rendezvous, rank: int
) -> None:
    """A spawned worker: leave with rank 0's process, join the group, serve the steps."""
    _exit_with_parent()
    groups = TPProcessGroups(rendezvous, rank, rank_device(config, rank))
    serve_steps(config, model_path, groups)


def serve_if_torchrun_worker(config: EngineConfig) -> bool:
    """Under torchrun with ``tp_size > 1`` (the job's WORLD_SIZE, ``EngineConfig`` checks) on a
    rank other than 0: join the job's group, serve rank 0's steps until it stops, then True.
    Elsewhere: False at once.
    """
    env = torchrun_env()
    if env is None or env.rank == 0 or config.tp_size == 1:
        return False
    from pcgspec.models.loader import resolve_model_dir

    groups = TPProcessGroups(
        Rendezvous.from_env(env), env.rank, rank_device(config, env.local_rank)
    )
    serve_steps(config, resolve_model_dir(config.model), groups)
    return True


def serve_steps(
    config: EngineConfig, model_path: Path | RandomWeights | None, groups: TPProcessGroups
) -> None:
    """Build this rank's runner as rank 0's ``WorkerSetup`` says (the same captures as rank 0,
    in the same order), warm its attention kernels up, then run every batch rank 0 sends until
    it says stop.
    """
    from pcgspec.engine.cpu_threads import apply_cpu_threads

    if config.log_level:
        logging.getLogger("pcgspec").setLevel(config.log_level.upper())
    apply_cpu_threads(config)
    setup = groups.from_rank0()
    if not isinstance(setup, WorkerSetup):
        raise TypeError(f"rank 0 sent {type(setup).__name__}, not a WorkerSetup")
    config = setup.config
    runner = ModelRunner(
        config,
        model_path,
        draft_kv_bytes_per_token=setup.draft_kv_bytes_per_token,
        drafter_reads_hidden=setup.drafter_reads_hidden,
        tp_groups=groups,
    )
    warm_up_kernels(_attention_warmup(config, runner), runner.device)
    channel = StepChannel(groups)
    logger.info("tensor parallel: rank %d of %d serving steps", groups.tp.rank, groups.tp.size)
    while (message := channel.recv()) is not None:
        if is_kv_move(message):
            runner.move_accepted_kv(*kv_move_from_message(message))
        else:
            runner.forward(from_message(message))
    runner.release_graphs()
    groups.destroy()


def _attention_warmup(config: EngineConfig, runner: ModelRunner) -> KernelWarmup:
    """The attention kernels a worker launches, and a draft tree's K/V move (sampling,
    verification and drafting run on rank 0)."""
    spec = config.speculative_config
    triton = config.resolved_attention_backend == "triton"
    return KernelWarmup(
        attention=(AttentionShape.of(runner.attn_backend),) if triton else (),
        split_kv_tokens=(1,) if spec is None else (1, spec.num_steps + 1),
        tree=None
        if spec is None or spec.topk == 1
        else (spec.num_steps, spec.num_draft_tokens, spec.topk),
    )


def _exit_with_parent() -> None:
    """Leave at once when rank 0's process ends, whatever this process is waiting on."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="pcgspec-tp-parent", daemon=True).start()
