"""A tensor-parallel worker process: its shard of the model, then rank 0's forwards, replayed.
Rank 0's ``ModelRunner`` hands ``run_worker`` to its ``TPDriver`` (distributed/launcher.py),
which spawns it: distributed/ runs a runner without importing runners/.

The worker never samples: rank 0 samples alone and the chosen tokens reach the workers as the
next step's ``input_ids``, so every rank computes on the same tokens by construction.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING

from pcgspec.distributed.broadcast import StepChannel
from pcgspec.distributed.launcher import rank_device
from pcgspec.distributed.process_group import Rendezvous, TPProcessGroups
from pcgspec.kernels.warmup import AttentionShape, KernelWarmup, warm_up_kernels
from pcgspec.runners.batch_wire import from_message
from pcgspec.runners.model_runner import ModelRunner

if TYPE_CHECKING:
    from pcgspec.config import EngineConfig
    from pcgspec.models.random_weights import RandomWeights

logger = logging.getLogger("pcgspec")


def run_worker(
    config: EngineConfig, model_path: Path | RandomWeights | None, rendezvous: Rendezvous, rank: int
) -> None:
    """Join the group, build this rank's runner (the same captures as rank 0, in the same
    order), warm its attention kernels up, then run every batch rank 0 broadcasts until it says
    stop.
    """
    from pcgspec.engine.cpu_threads import apply_cpu_threads

    _exit_with_parent()
    if config.log_level:
        logging.getLogger("pcgspec").setLevel(config.log_level.upper())
    apply_cpu_threads(config)
    groups = TPProcessGroups(rendezvous, rank, rank_device(config, rank))
    runner = ModelRunner(config, model_path, tp_groups=groups)
    warm_up_kernels(_attention_warmup(config, runner), runner.device)
    channel = StepChannel(groups)
    while (message := channel.recv()) is not None:
        runner.forward(from_message(message))
    runner.release_graphs()
    groups.destroy()


def _attention_warmup(config: EngineConfig, runner: ModelRunner) -> KernelWarmup:
    """The attention kernels a worker launches (sampling and verification run on rank 0)."""
    spec = config.speculative_config
    triton = config.resolved_attention_backend == "triton"
    return KernelWarmup(
        attention=(AttentionShape.of(runner.attn_backend),) if triton else (),
        split_kv_tokens=(1,) if spec is None else (1, spec.num_steps + 1),
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
