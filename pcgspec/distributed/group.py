"""``TPGroup``: this process's place in a tensor-parallel group, handed to every sharded layer.

A frozen value (rank, size, the process group's name), passed explicitly from the runner to the
model; nothing here is global. ``size == 1`` is the single-device model: no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pcgspec.compile.custom_ops  # noqa: F401  (registers the collectives)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group_name: str | None = None  # the torch process group of the device collectives

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size must be a positive integer, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank!r}")
        if (self.size > 1) != (self.group_name is not None):
            raise ValueError(
                f"group_name must be set exactly when size > 1, got "
                f"{self.group_name!r} for size {self.size}"
            )

    def shard(self, total: int, what: str) -> int:
        """``total / size``; ``ValueError`` naming ``what`` when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tp_size ({self.size})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (graph-capturable, compiled inside a piece)."""
        if self.size == 1:
            return x
        return torch.ops.pcgspec.all_reduce(x, self.group_name)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [..., N] concatenated in rank order: [..., size * N]."""
        if self.size == 1:
            return x
        parts = torch.ops.pcgspec.all_gather(x, self.group_name, self.size)  # [size, ..., N]
        return torch.cat(parts.unbind(0), dim=-1)


SINGLE = TPGroup()
