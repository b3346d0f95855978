"""Rank 0 hands each step's inputs to the workers as one int64 device message, no pickling.

A message is ``[total, meta_len, n_floats, (dtype, ndim, *shape) per float, *header,
*payload]``: a header of host integers laid out by the sender's codec (``runners/batch_wire.py``
for a ``ForwardBatch``), then every integer tensor flattened to int64. The first ``capacity``
words go in one device broadcast whose size every rank knows in advance, so a step whose message
fits (decode steps of ordinary batches) costs one broadcast; a longer one sends the rest in a
second. Floating tensors (input embeddings, when set) follow, one broadcast each. ``total == 0``
means stop.

On rank 0 sending never waits on the device: the header is copied up without a sync and the
payload is packed by device copies queued behind the step's producers. A worker copies the
first ``capacity`` words to the host (one small device-to-host copy per step; it has nothing
else to do meanwhile) to read the header and the shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pcgspec.distributed.process_group import TPProcessGroups

CAPACITY = 4096  # words of the fixed first broadcast (32 KiB)
SPIN_S = 0.05  # a worker waiting for a step spins this long, then polls every IDLE_POLL_S
IDLE_POLL_S = 0.0002
DTYPES = (
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
)
_META = 3  # total, meta_len, n_floats


@dataclass(frozen=True)
class StepMessage:
    header: list[int]  # host integers, laid out by the codec
    ints: list[torch.Tensor]  # rank 0: integer tensors to flatten; a worker: [payload] (int64)
    floats: list[torch.Tensor]  # floating tensors, one broadcast each


class StepChannel:
    def __init__(self, groups: TPProcessGroups, capacity: int = CAPACITY) -> None:
        if capacity < 64:
            raise ValueError(f"capacity must be at least 64 words, got {capacity}")
        self.group = groups.step_group
        self.device = groups.device
        self.capacity = capacity
        self._inbox = torch.empty(capacity, dtype=torch.int64, device=groups.device)

    def send(self, message: StepMessage) -> None:
        """Rank 0: broadcast ``message`` to every worker."""
        meta = [0, 0, len(message.floats)]
        for t in message.floats:
            meta += [DTYPES.index(t.dtype), t.dim(), *t.shape]
        meta += message.header
        meta_len = len(meta)
        total = meta_len + sum(t.numel() for t in message.ints)
        meta[0], meta[1] = total, meta_len
        out = torch.empty(max(total, self.capacity), dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        out[:meta_len].copy_(torch.tensor(meta, dtype=torch.int64, pin_memory=cuda), cuda)
        offset = meta_len
        for t in message.ints:
            out[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        self._broadcast(out[: self.capacity])
        if total > self.capacity:
            self._broadcast(out[self.capacity : total])
        for t in message.floats:
            self._broadcast(t.contiguous())

    def stop(self) -> None:
        """Rank 0: tell the workers to leave their loop (returns once the message is out)."""
        self._broadcast(torch.zeros(self.capacity, dtype=torch.int64, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def recv(self) -> StepMessage | None:
        """Workers: the next message (``ints``: the payload, one int64 device tensor), or None
        when rank 0 stopped.
        """
        first = self._broadcast(self._inbox)
        if self.device.type == "cuda":
            _wait_for_stream()
        host = first.cpu()
        total, meta_len = host[:2].tolist()
        if total == 0:
            return None
        message = first
        if total > self.capacity:
            rest = torch.empty(total - self.capacity, dtype=torch.int64, device=self.device)
            message = torch.cat([first, self._broadcast(rest)])
            if meta_len > self.capacity:
                host = torch.cat([host, rest[: meta_len - self.capacity].cpu()])
        meta = host[:meta_len].tolist()
        floats, i = [], _META
        for _ in range(meta[2]):
            dtype, ndim = DTYPES[meta[i]], meta[i + 1]
            shape = meta[i + 2 : i + 2 + ndim]
            floats.append(torch.empty(shape, dtype=dtype, device=self.device))
            i += 2 + ndim
        for t in floats:
            self._broadcast(t)
        payload = message[meta_len:total]
        if message is self._inbox:  # NOTE: the next step's broadcast overwrites the inbox
            payload = payload.clone()
        return StepMessage(meta[i:], [payload], floats)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self.group)
        return t


def _wait_for_stream() -> None:
    """Wait for the current stream (the step's broadcast): spinning while steps come back to
    back, then sleeping between polls, so that an idle worker does not hold a core in a sync.
    """
    done = torch.cuda.Event()
    done.record()
    spin_until = time.monotonic() + SPIN_S
    while not done.query():
        if time.monotonic() > spin_until:
            time.sleep(IDLE_POLL_S)
