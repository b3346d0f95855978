"""What every drafter shares: its input, its output (``DraftProposal``) and the ``Proposer``
interface. A speculative step is propose -> verify -> accept -> commit/rollback; a proposer
does the first phase only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

FILLER_TOKEN = 0  # pads a request's drafts past num_tokens; any valid id works (see below)


@dataclass(frozen=True)
class DraftProposal:
    """k draft tokens per request (a chain), of which the first ``num_tokens[b]`` are real, or
    a draft tree (``parents``, ``depths``: ``speculative/tree.py``) of N - 1 = k drafts.

    Padding entries hold ``FILLER_TOKEN``: the target still runs on them (k+1 tokens per request
    keep verify shapes static), and ``verify_draft_tokens(num_draft=num_tokens)`` caps the
    accepted length, so a filler is never accepted whatever it matches.
    """

    tokens: torch.Tensor  # [B, k] int64 (a tree: nodes 1..N-1)
    num_tokens: torch.Tensor  # [B] int64 in 0..k
    probs: torch.Tensor | None = None  # [B, k, V] f32 draft distributions; None: deterministic
    parents: torch.Tensor | None = None  # [B, k+1] int64 node parents (root -1); None: a chain
    depths: torch.Tensor | None = None  # [B, k+1] int64 node depths, with ``parents``
    tree_mask: torch.Tensor | None = None  # [B, k+1, k+1] bool ancestor masks, if built

    def __post_init__(self) -> None:
        tokens, num = self.tokens, self.num_tokens
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(
                f"tokens must be [B, k] int64, got {list(tokens.shape)} {tokens.dtype}"
            )
        if num.shape != tokens.shape[:1] or num.dtype != torch.int64:
            raise ValueError(
                f"num_tokens must be [{tokens.shape[0]}] int64, got {list(num.shape)} {num.dtype}"
            )
        if self.probs is not None and (
            self.probs.dim() != 3 or self.probs.shape[:2] != tokens.shape
        ):
            raise ValueError(
                f"probs must be [{tokens.shape[0]}, {tokens.shape[1]}, V], got "
                f"{list(self.probs.shape)}"
            )
        nodes = (tokens.shape[0], tokens.shape[1] + 1)
        if (self.parents is None) != (self.depths is None) or (
            self.parents is not None and not self.parents.shape == self.depths.shape == nodes
        ):
            raise ValueError("parents and depths must both be [B, k+1] or both None")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_steps(self) -> int:
        """k."""
        return self.tokens.shape[1]


@dataclass(frozen=True)
class ProposeInput:
    """What a proposer sees of the running batch."""

    requests: Sequence[Any]  # the engine's Request objects (tokens, pages), in batch order
    seq_lens: torch.Tensor  # [B] int64 on the device: their token counts as of the device
    # [B, P] int32 on the device: their pages, reserved for the step (``device_page_table``);
    # None where the proposer writes no KV (prompt lookup)
    page_table: torch.Tensor | None = None


@dataclass(frozen=True)
class CapturedStep:
    """What a proposer's drafting sees inside a captured speculative step
    (``runners/spec_step_graphs.py``): a bucket of ``bs`` requests, those past the batch
    padding (``valid`` False), all on the device."""

    slots: torch.Tensor  # [bs] int64 sampling slots (padding: 0)
    valid: torch.Tensor  # [bs] bool
    seq_lens: torch.Tensor  # [bs] int64 token counts before the step
    page_table: torch.Tensor  # [bs, P] int32
    max_seq_len: int  # bound of every length in the step (for sizing)


class Proposer(ABC):
    """Drafts ``num_steps`` (k) tokens per request; deterministic for a given input."""

    num_steps: int
    # Whether the last ``propose`` first caught requests up over positions of plain steps or a
    # new prompt (model drafters): a step that switched to speculation, not a steady one.
    caught_up: bool = False

    @abstractmethod
    def propose(self, batch: ProposeInput) -> DraftProposal:
        """One ``DraftProposal`` for the batch's requests, in order."""

    def observe(
        self,
        requests: Sequence[Any],
        starts: Sequence[int],
        nums: Sequence[int],
        hidden: torch.Tensor | None,
    ) -> None:
        """A plain target pass computed ``nums[i]`` positions of each of ``requests`` from
        position ``starts[i]``, their rows consecutive in that order in ``hidden`` (the pass's
        captured states, or None); finished requests are skipped. Drafters that keep
        per-request state update it here; one call per pass, so a drafter pays only for the
        loop it needs.
        """
        return None

    def verified(self, requests: Sequence[Any], out: Any, hidden: torch.Tensor | None) -> object:
        """A verify pass was launched on ``requests`` (``out``: its ``VerifyOutput`` on the
        device; ``hidden``: its captured states, ``[B * (k+1), Hh]``, or None). Returns what
        the drafter keeps of it, handed back to ``read`` with the step's results.
        """
        return None

    def checkpoint(self) -> object:
        """What ``rollback`` restores when the step launched after it fails (isolation.py)."""
        return None

    def rollback(self, checkpoint: object) -> None:
        """A step failed and its requests run again: forget what it kept (``verified``)."""
        return None

    # a speculative step captured whole (``SpecStepGraphs``) ---------------------------------

    def reserve_step_rows(self, max_bs: int) -> None:
        """Allocate what ``propose_captured`` reads, for up to ``max_bs`` requests."""
        return None

    def prepare_replay(self, requests: Sequence[Any]) -> None:
        """Host work before a captured step of ``requests`` replays: whatever its drafting
        reads must be on the device by then."""
        return None

    def propose_captured(self, step: CapturedStep) -> DraftProposal:
        """The drafting of a captured step, from device state only."""
        raise NotImplementedError(f"{type(self).__name__} drafts only eagerly")

    def keep_captured(self, step: CapturedStep, out: Any, hidden: torch.Tensor | None) -> None:
        """Inside a captured step, after acceptance (``out``: its ``VerifyOutput``, path rows
        in ``hidden``): keep on the device what the next step's drafting reads."""
        return None

    def replayed(self, requests: Sequence[Any]) -> object:
        """``verified`` for a captured step of ``requests`` that just replayed."""
        return None

    def read(self, request: Any, rows: object, row: int, start: int, num: int) -> None:
        """The host read a verify step's results: ``request`` (row ``row`` of the step; ``rows``
        is what ``verified`` returned) committed ``num`` tokens from position ``start``.
        """
        return None
