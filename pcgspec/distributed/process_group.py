"""The process groups of one tensor-parallel rank: device collectives (NCCL on CUDA, gloo on
CPU), the step channel's group (on CUDA a second NCCL group without a practical timeout, since
a worker waits there for the next step however long the engine idles) and a gloo group for
host agreements at start-up.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pcgspec import envs
from pcgspec.distributed import symm_mem
from pcgspec.distributed.group import TPGroup
from pcgspec.envs import TorchrunEnv

# NOTE: NVLink multicast (NVLS) can take a shared host's GPUs out of service: off in every
# process pcgspec starts, set before NCCL or symmetric memory initialize.
NVLINK_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Workers wait on the step group for the next step however long the engine idles.
HOST_GROUP_TIMEOUT = timedelta(days=365)
DEVICE_GROUP_TIMEOUT = timedelta(minutes=10)


def disable_nvlink_multicast() -> None:
    os.environ.update(NVLINK_MULTICAST_OFF)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet (picklable, handed to every worker)."""

    init_method: str  # tcp://host:port of rank 0's store, or env:// (torchrun's variables)
    size: int

    @classmethod
    def from_env(cls, env: TorchrunEnv) -> Rendezvous:
        """The group ``torchrun`` started: every process of its job is one rank."""
        return cls("env://", env.world_size)

    @classmethod
    def local(cls, size: int) -> Rendezvous:
        """A free port on this host (single-host tensor parallelism)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return cls(f"tcp://127.0.0.1:{port}", size)


class TPProcessGroups:
    """This process's membership: joins the group (blocking until every rank has), then runs
    one device all-reduce so NCCL's communicator exists before any CUDA graph capture.
    """

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device) -> None:
        disable_nvlink_multicast()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=rendezvous.init_method,
            rank=rank,
            world_size=rendezvous.size,
            timeout=DEVICE_GROUP_TIMEOUT if cuda else HOST_GROUP_TIMEOUT,
            device_id=device if cuda else None,
        )
        self.device = device
        self.device_group = dist.group.WORLD
        self.host_group = self.step_group = self.device_group
        if cuda:
            self.host_group = dist.new_group(backend="gloo", timeout=HOST_GROUP_TIMEOUT)
            self.step_group = dist.new_group(backend="nccl", timeout=HOST_GROUP_TIMEOUT)
        self.tp = TPGroup(rank, rendezvous.size, self.device_group.group_name)
        dist.all_reduce(torch.ones(1, device=device), group=self.device_group)
        dist.broadcast(torch.ones(1, device=device), src=0, group=self.step_group)
        self._enable_symm_mem()

    def _enable_symm_mem(self) -> None:
        """CUDA, every rank on one host, ``PCGSPEC_TP_SYMM_MEM_MAX_BYTES`` > 0: small all-reduces
        over peer memory (``symm_mem.py``)."""
        max_bytes = envs.tp_symm_mem_max_bytes()
        job = envs.torchrun_env()
        one_host = job is None or job.local_world_size == job.world_size
        if self.device.type == "cuda" and max_bytes and one_host:
            symm_mem.enable(self.tp.group_name, self.device, max_bytes)

    def from_rank0(self, value: object = None) -> object:
        """Rank 0's ``value`` on every rank (pickled over the host group: start-up only)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank holds (e.g. KV pages: every rank needs the same)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def destroy(self) -> None:
        """Leave the groups (after the runner released its graphs: ``release_graphs``)."""
        symm_mem.disable(self.tp.group_name)
        if dist.is_initialized():
            dist.destroy_process_group()

    def abort(self) -> None:
        """CUDA: abort every communicator of this rank, so that a blocked NCCL call returns."""
        if self.device.type == "cuda" and dist.is_initialized():
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
