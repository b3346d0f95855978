"""How many intra-op threads torch runs with on the CPU device.

torch's own default is one thread per core of the machine, whatever else runs there: on a
busy 2-core machine two threads then spin against each other and against the other load (a
32-token generate took 39.4 s that way, 3.2 s with one thread). pcgspec chooses instead, as
llama.cpp does, one thread per physical core this process may use (affinity and cgroup CPU
quota), capped at ``CPU_THREADS_CAP``, then leaves out the cores the load average says others
are using, and splits what is left between tensor-parallel ranks (vLLM's CPU backend likewise
keeps cores free beside its workers).

Nothing here runs at import: torch's global thread count changes only when the first engine on
the CPU starts (``apply_cpu_threads``), and only then: the count is process-wide, and a compiled
decoder guards on it, so a later change would make every engine traced before it recompile
(refused: a recompile is a bug).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pcgspec.config import EngineConfig

logger = logging.getLogger("pcgspec")
_chosen: int | None = None  # the count the process's first CPU engine set
CPU_THREADS_CAP = 16  # NOTE: a small model's matmuls gain little past this; --cpu-threads goes on
_SYS_CPU = Path("/sys/devices/system/cpu")
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuInfo:
    allowed: int  # CPUs this process may run on (affinity, cgroup quota)
    physical: int  # distinct physical cores among them
    online: int  # CPUs of the machine, over which the load average is spread
    load: float  # 1-minute load average (runnable tasks, this process's own share included)

    @classmethod
    def probe(cls) -> CpuInfo:
        online = os.cpu_count() or 1
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        allowed = min(len(cpus) or online, _cgroup_quota() or online)
        physical = min(_physical_cores(cpus) or allowed, allowed)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return cls(allowed, physical, online, load)


def default_cpu_threads(info: CpuInfo, tp_size: int = 1) -> int:
    """Threads for each of ``tp_size`` processes: the physical cores (at most
    ``CPU_THREADS_CAP``), fewer where the load leaves fewer CPUs idle; at least 1.
    """
    idle = info.allowed * max(0.0, 1.0 - info.load / info.online)
    return max(1, min(info.physical, round(idle), CPU_THREADS_CAP) // tp_size)


def apply_cpu_threads(config: EngineConfig) -> None:
    """Set torch's intra-op threads for the first engine (or tensor-parallel rank) on the CPU
    in this process: ``config.cpu_threads`` when given, else the count ``OMP_NUM_THREADS``
    already gave torch, else ``default_cpu_threads``. Later engines keep that count. Does
    nothing for CUDA devices.
    """
    global _chosen
    if config.torch_device.type != "cpu":
        return
    import torch

    if _chosen is not None:  # NOTE: process-wide, and the engines traced so far guard on it
        if config.cpu_threads not in (None, _chosen):
            logger.warning(
                "cpu_threads=%d ignored: this process's engines run with %d "
                "(torch's thread count is process-wide)",
                config.cpu_threads,
                _chosen,
            )
        return

    if config.cpu_threads is not None:
        threads, why = config.cpu_threads, "cpu_threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        info = CpuInfo.probe()
        threads = default_cpu_threads(info, config.tp_size)
        why = (
            f"{info.physical} physical of {info.allowed} usable CPUs, load {info.load:.1f}; "
            "--cpu-threads to choose"
        )
    torch.set_num_threads(threads)
    _chosen = threads
    logger.info("CPU threads: %d (%s)", threads, why)


def _physical_cores(cpus: list[int]) -> int:
    """Distinct (package, core) pairs among ``cpus``; 0 when the topology is not readable."""
    cores = set()
    for cpu in cpus:
        topology = _SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                (
                    (topology / "physical_package_id").read_text().strip(),
                    (topology / "core_id").read_text().strip(),
                )
            )
        except OSError:
            return 0
    return len(cores)


def _cgroup_quota() -> int | None:
    """CPUs the cgroup's CPU quota allows (rounded up); None without a quota."""
    v1 = _CGROUP / "cpu"
    for files in ((_CGROUP / "cpu.max",), (v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us")):
        try:
            words = " ".join(f.read_text() for f in files).split()
        except OSError:
            continue
        return _quota_cpus(*words[:2]) if len(words) >= 2 else None
    return None


def _quota_cpus(quota: str, period: str) -> int | None:
    """``quota`` microseconds of CPU time per ``period`` as whole CPUs ("max" or -1: none)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return -(-q // p) if q > 0 and p > 0 else None
