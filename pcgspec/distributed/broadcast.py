"""Rank 0 hands each forward's ``ForwardBatch`` to the workers, which run the same forward.
The channel sends any dataclass of tensors and host values; the header names its class, so
this module needs no import of runners/.

Per step: one pickled header on the host group (mode, host-side lengths, tensor shapes), one
device broadcast of every integer tensor packed into a single int64 buffer, and one more per
floating tensor (``input_embeds``, when set). The sampling tensors stay on rank 0, the only
rank that samples.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pcgspec.distributed.process_group import TPProcessGroups

_RANK0_ONLY = frozenset({"sampling"})


@dataclass(frozen=True)
class _Header:
    kind: type  # the batch's dataclass (pickled by name)
    values: dict[str, Any]  # the host-side fields
    ints: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # packed, in this order
    floats: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # one broadcast each


class BatchChannel:
    def __init__(self, groups: TPProcessGroups) -> None:
        self.groups = groups

    def send(self, batch: Any) -> None:
        """Rank 0: broadcast ``batch`` to every worker."""
        values: dict[str, Any] = {}
        ints: list[tuple[str, torch.Tensor]] = []
        floats: list[tuple[str, torch.Tensor]] = []
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                (floats if value.is_floating_point() else ints).append((f.name, value))
            elif f.name not in _RANK0_ONLY:
                values[f.name] = value
        spec = lambda pairs: tuple((n, tuple(t.shape), t.dtype) for n, t in pairs)  # noqa: E731
        self._header(_Header(type(batch), values, spec(ints), spec(floats)))
        if ints:
            self._tensor(torch.cat([t.reshape(-1).to(torch.int64) for _, t in ints]))
        for _, t in floats:
            self._tensor(t.contiguous())

    def stop(self) -> None:
        """Rank 0: tell the workers to leave their loop."""
        self._header(None)

    def recv(self) -> Any:
        """Workers: the next batch, or None when rank 0 stopped."""
        header = self._header(None)
        if header is None:
            return None
        device, fields = self.groups.device, dict(header.values)
        if header.ints:
            sizes = [math.prod(shape) for _, shape, _ in header.ints]
            flat = self._tensor(torch.empty(sum(sizes), dtype=torch.int64, device=device))
            for (name, shape, dtype), part in zip(header.ints, flat.split(sizes)):
                fields[name] = part.view(shape).to(dtype)
        for name, shape, dtype in header.floats:
            fields[name] = self._tensor(torch.empty(shape, dtype=dtype, device=device))
        return header.kind(**fields)

    def _header(self, header: _Header | None) -> _Header | None:
        box = [header]
        dist.broadcast_object_list(box, src=0, group=self.groups.host_group)
        return box[0]

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self.groups.device_group)
        return t
