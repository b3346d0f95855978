"""A one-shot all-reduce over peer memory for small messages, through PyTorch's symmetric memory
(``torch.ops.symm_mem.one_shot_all_reduce_out``): each rank copies its input into a buffer every
rank can read, and one kernel sums every peer's copy. At batch-1 decode sizes this replaces a
latency-bound NCCL ring; above ``max_bytes``, off CUDA and across hosts, NCCL stays.

On when ``PCGSPEC_TP_SYMM_MEM_MAX_BYTES`` > 0 (off by default) and every rank is on one host.
The choice is made per call, so under CUDA graph capture each bucket records the path its size
takes. Never a multicast (multimem) op: NVLink multicast stays off. Tested on GPUs only
(``tests/test_tp_gpu.py``); on CPU this module is never entered.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger("pcgspec")


@dataclass
class SymmBuffer:
    group_name: str
    buffer: torch.Tensor  # [max_bytes] uint8, symmetric across the group's ranks
    calls: int = 0  # Python calls (eager steps and graph captures)

    @property
    def max_bytes(self) -> int:
        return self.buffer.numel()


_BUFFERS: dict[str, SymmBuffer] = {}
ONE_SHOT_DTYPES = (torch.float32, torch.bfloat16)


def enable(group_name: str, device: torch.device, max_bytes: int) -> SymmBuffer:
    """Allocate and exchange the group's buffer (collective: every rank calls it, in the same
    order as its other collectives).
    """
    import torch.distributed._symmetric_memory as symm_mem

    if max_bytes % 16:
        raise ValueError(f"max_bytes must be a multiple of 16, got {max_bytes}")
    with warnings.catch_warnings():  # NOTE: older torch needs it, newer ones deprecate it
        warnings.filterwarnings("ignore", "`enable_symm_mem_for_group`", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group_name)
    buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group_name)
    _BUFFERS[group_name] = SymmBuffer(group_name, buffer)
    logger.info("tensor parallel: one-shot all-reduce up to %d bytes (symmetric memory)", max_bytes)
    return _BUFFERS[group_name]


def disable(group_name: str) -> None:
    _BUFFERS.pop(group_name, None)


def buffer_for(x: torch.Tensor, group_name: str) -> SymmBuffer | None:
    """The group's buffer when ``x`` takes the one-shot path, else None (NCCL): a CUDA tensor of
    a dtype the kernel sums (float32, bfloat16), whole 4-byte words, at most ``max_bytes``.
    """
    symm = _BUFFERS.get(group_name)
    nbytes = x.numel() * x.element_size()
    if symm is None or not x.is_cuda or x.dtype not in ONE_SHOT_DTYPES:
        return None
    return symm if nbytes <= symm.max_bytes and nbytes % 4 == 0 else None


def one_shot_all_reduce(x: torch.Tensor, symm: SymmBuffer) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks, as a new tensor."""
    symm.calls += 1
    nbytes = x.numel() * x.element_size()
    staged = symm.buffer[:nbytes].view(x.dtype).view(x.shape)  # NOTE: offset 0 of the buffer
    staged.copy_(x)
    out = torch.empty_like(x)
    return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", symm.group_name, out)
