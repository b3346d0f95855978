"""The TTT loss: soft cross-entropy of every unrolled step against the target's distribution
over the draft vocabulary, on response tokens only, plus per-step accuracy counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pcgspec.models.eagle3 import Eagle3Head
from pcgspec.training.model import unroll

TARGET_CHUNK_ROWS = 4096  # rows of target logits [rows, V] materialized at once


@dataclass(frozen=True)
class Batch:
    """Packed sequences on the training device: each of the ``B`` lines holds one or more
    whole sequences, one after another, then padding. Attention, positions and the loss stay
    within a sequence.
    """

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool: response tokens (never padding)
    aux: torch.Tensor  # [B, T, 3H] the target's aux hidden states
    final: torch.Tensor  # [B, T, H] the target's final normed hidden state
    # [B, T] int64: which sequence of its line a token belongs to (0, 1, ...; padding -1);
    # None: one sequence per line
    seq: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [B, T] int64, within the sequence; None: 0, 1, ...
    chat: torch.Tensor | None = None  # [B, T] bool: of a chat-template sequence; None: none is

    def __post_init__(self) -> None:
        shape, device = self.input_ids.shape, self.input_ids.device
        if self.seq is None:
            object.__setattr__(self, "seq", torch.zeros(shape, dtype=torch.long, device=device))
        if self.positions is None:
            columns = torch.arange(shape[1], device=device)
            object.__setattr__(self, "positions", columns.expand(shape))
        if self.chat is None:
            object.__setattr__(self, "chat", torch.zeros(shape, dtype=torch.bool, device=device))

    def chat_window(self, tokens: int) -> Batch:
        """The same lines with the loss mask kept on the first ``tokens`` response tokens of
        chat-template sequences only (the same shapes: a compiled loss runs it as it is).
        """
        mask = self.loss_mask & self.chat
        counted = mask.long().cumsum(dim=1)  # [B, T] response tokens up to here, in the line
        columns = torch.arange(mask.shape[1], device=mask.device)
        starts = torch.ones_like(mask)
        starts[:, 1:] = self.seq[:, 1:] != self.seq[:, :-1]
        first = torch.where(starts, columns, 0).cummax(dim=1).values  # the sequence's start
        before = (counted - mask.long()).gather(1, first)  # counted before the sequence
        return replace(self, loss_mask=mask & (counted - before <= tokens))


@dataclass(frozen=True)
class StepCounts:
    """Per unrolled step: weighted-loss terms and accuracy counts (tensors, no host sync)."""

    loss: torch.Tensor  # [S] mean soft cross-entropy
    correct: torch.Tensor  # [S] rows whose draft argmax is the target's argmax
    count: torch.Tensor  # [S] rows counted


def step_weights(num_steps: int, decay: float, device: torch.device) -> torch.Tensor:
    """``[num_steps]`` float32: the loss weight of each step, ``decay ** i``, normalized to sum
    to 1. Computed on ``device``: a tensor built from host values would be a blocking copy,
    which waits for the step before on every step.
    """
    raw = decay ** torch.arange(num_steps, dtype=torch.float64, device=device)
    return (raw / raw.sum()).float()


def ttt_loss(
    head: Eagle3Head, batch: Batch, num_steps: int, decay: float, compiled: bool = False
) -> tuple[torch.Tensor, StepCounts]:
    """The weighted TTT loss of ``batch`` and its per-step counts; ``compiled``: the unrolled
    steps and their losses through ``torch.compile``, fused kernels instead of eager ones (one
    graph per grad mode and batch shape: the trainer's batches all have one shape).
    """
    target_logits, target_ids = target_view(head, batch.final)
    loss_fn = _compiled_unrolled_loss if compiled else unrolled_loss
    weights = step_weights(num_steps, decay, target_ids.device)
    loss, counts = loss_fn(
        head,
        batch.input_ids,
        batch.loss_mask,
        batch.aux,
        batch.seq,
        batch.positions,
        target_logits,
        target_ids,
        weights,
    )
    return loss, StepCounts(*counts)


def unrolled_loss(
    head: Eagle3Head,
    input_ids: torch.Tensor,  # [B, T]
    loss_mask: torch.Tensor,  # [B, T]
    aux: torch.Tensor,  # [B, T, 3H]
    seq: torch.Tensor,  # [B, T] which sequence of its line
    positions: torch.Tensor,  # [B, T] within the sequence
    target_logits: torch.Tensor,  # [B, T, Vd]
    target_ids: torch.Tensor,  # [B, T]
    weights: torch.Tensor,  # [S] the steps' loss weights
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The weighted loss of ``len(weights)`` unrolled steps and their per-step loss, correct
    and counted rows (``StepCounts``' fields).
    """
    n = input_ids.shape[1] - 1
    target_probs = target_logits.float().softmax(dim=-1)  # [B, T, Vd]
    losses, correct, count = [], [], []
    for step, logits in enumerate(unroll(head, input_ids, aux, seq, positions, len(weights))):
        # row t of step i predicts token t+2+i (rows t < m have one) where it is of the same
        # sequence; the target's distribution of it is at t+1+i
        m = max(0, n - 1 - step)
        ahead, behind = slice(2 + step, 2 + step + m), slice(1 + step, 1 + step + m)
        mask = loss_mask[:, ahead] & (seq[:, :m] == seq[:, ahead])  # [B, m]
        probs = target_probs[:, behind]  # [B, m, Vd]
        ce = -(probs * logits[:, :m].float().log_softmax(dim=-1)).sum(dim=-1)  # [B, m]
        rows = mask.sum()
        losses.append((ce * mask).sum() / rows.clamp(min=1))
        drafted = head.draft_to_target[logits[:, :m].argmax(dim=-1)]
        correct.append((drafted == target_ids[:, behind]).logical_and(mask).sum())
        count.append(rows)
    loss = torch.stack(losses)
    return (loss * weights).sum(), (loss.detach(), torch.stack(correct), torch.stack(count))


_compiled_unrolled_loss = torch.compile(unrolled_loss, dynamic=False)


@torch.no_grad()
def target_view(head: Eagle3Head, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits over the draft vocabulary ``[B, T, Vd]`` and its argmax over the
    whole vocabulary ``[B, T]`` (target ids), from its final hidden states ``[B, T, H]``, at
    every position (the loss masks the ones it does not read; picking them out would cost the
    host a wait for the device each step).
    """
    weight = head.shared.lm_head.weight  # [V, H]
    draft_ids = head.draft_to_target
    parts_logits, parts_argmax = [], []
    for chunk in final.reshape(-1, final.shape[-1]).split(TARGET_CHUNK_ROWS):
        full = chunk.to(weight.dtype) @ weight.T  # [r, V]
        parts_argmax.append(full.argmax(dim=-1))
        parts_logits.append(full[:, draft_ids])
    shape = final.shape[:-1]
    return torch.cat(parts_logits).view(*shape, -1), torch.cat(parts_argmax).view(shape)
