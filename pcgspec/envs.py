"""Every environment flag pcgspec reads, typed, with the ``PCGSPEC_`` prefix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else default


def cache_dir() -> Path:
    """Where converted models and compile caches live (``PCGSPEC_CACHE_DIR``)."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
    return _path("PCGSPEC_CACHE_DIR", xdg / "pcgspec")


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_level() -> str:
    """Log level of the ``pcgspec`` logger (``PCGSPEC_LOG_LEVEL``, default INFO)."""
    return os.environ.get("PCGSPEC_LOG_LEVEL", "INFO").upper()


def cpu_piecewise() -> bool:
    """Run the piecewise path on CPU too (``PCGSPEC_CPU_PIECEWISE=1``; off by default: without
    graphs it only adds the decoder's trace to start-up).
    """
    return os.environ.get("PCGSPEC_CPU_PIECEWISE", "0").lower() in ("1", "true", "yes")


def api_key() -> str | None:
    """The server's Bearer key when ``--api-key`` is not given (``PCGSPEC_API_KEY``); an
    environment variable keeps the key out of the process list."""
    return os.environ.get("PCGSPEC_API_KEY") or None


def tp_symm_mem_max_bytes() -> int:
    """Tensor-parallel all-reduces of at most this many bytes take the one-shot path over
    symmetric memory on one host of GPUs (``PCGSPEC_TP_SYMM_MEM_MAX_BYTES``; 0, the default: every
    all-reduce on NCCL).
    """
    raw = os.environ.get("PCGSPEC_TP_SYMM_MEM_MAX_BYTES", "0")
    if not raw.isdigit():
        raise ValueError(f"PCGSPEC_TP_SYMM_MEM_MAX_BYTES must be a byte count, got {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a job ``torchrun`` (or another ``env://`` launcher) started;
    ``MASTER_ADDR`` and ``MASTER_PORT`` are read by torch's ``env://`` rendezvous itself.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env() -> TorchrunEnv | None:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as ``torchrun`` sets
    them, or None when this process was not started so (no ``RANK``/``WORLD_SIZE``/
    ``MASTER_ADDR``).
    """
    if not all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(name, "1" if name == "LOCAL_WORLD_SIZE" else "0")
        if not raw.isdigit():
            raise ValueError(
                f"environment variable {name} must be a non-negative integer, got {raw!r}"
            )
        values[name.lower()] = int(raw)
    env = TorchrunEnv(**values)
    if not (env.rank < env.world_size and env.local_rank < env.local_world_size):
        raise ValueError(f"torchrun environment out of range: {env}")
    return env
