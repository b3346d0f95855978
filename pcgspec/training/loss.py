"""The TTT loss: soft cross-entropy of every unrolled step against the target's distribution
over the draft vocabulary, on response tokens only, plus per-step accuracy counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcgspec.models.eagle3 import Eagle3Head
from pcgspec.training.model import shifted, unroll

TARGET_CHUNK_ROWS = 4096  # rows of target logits [rows, V] materialized at once


@dataclass(frozen=True)
class Batch:
    """Padded sequences on the training device."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool: response tokens (never padding)
    aux: torch.Tensor  # [B, T, 3H] the target's aux hidden states
    final: torch.Tensor  # [B, T, H] the target's final normed hidden state

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def response_window(self, rows: torch.Tensor, tokens: int) -> Batch | None:
        """The sequences ``rows [B]`` (bool) picks, with the loss mask ending after their first
        ``tokens`` response tokens and the columns past its end dropped (attention is causal:
        a kept row sees what it saw in the whole batch); None when no response token is left.
        """
        mask = self.loss_mask[rows]
        mask = mask & (mask.cumsum(dim=1) <= tokens)  # [b, T]
        columns = mask.any(dim=0).nonzero()
        if not len(columns):
            return None
        end = int(columns[-1]) + 1
        return Batch(self.input_ids[rows, :end], mask[:, :end], self.aux[rows, :end],
                     self.final[rows, :end])  # fmt: skip


@dataclass(frozen=True)
class StepCounts:
    """Per unrolled step: weighted-loss terms and accuracy counts (tensors, no host sync)."""

    loss: torch.Tensor  # [S] mean soft cross-entropy
    correct: torch.Tensor  # [S] rows whose draft argmax is the target's argmax
    count: torch.Tensor  # [S] rows counted


def step_weights(num_steps: int, decay: float) -> list[float]:
    """Loss weight of each step, ``decay ** i``, normalized to sum to 1."""
    raw = [decay**i for i in range(num_steps)]
    return [w / sum(raw) for w in raw]


def ttt_loss(
    head: Eagle3Head, batch: Batch, num_steps: int, decay: float
) -> tuple[torch.Tensor, StepCounts]:
    """The weighted TTT loss of ``batch`` and its per-step counts."""
    n = batch.input_ids.shape[1] - 1
    target_logits, target_ids = target_view(head, batch.final)
    losses, correct, count = [], [], []
    for step, logits in enumerate(unroll(head, batch.input_ids, batch.aux, num_steps)):
        # row t of step i predicts token t+2+i; the target's distribution of it is at t+1+i
        mask = shifted(batch.loss_mask, 2 + step, n)  # [B, n]
        probs = shifted(target_logits, 1 + step, n).float().softmax(dim=-1)  # [B, n, Vd]
        ce = -(probs * logits.float().log_softmax(dim=-1)).sum(dim=-1)  # [B, n]
        rows = mask.sum()
        losses.append((ce * mask).sum() / rows.clamp(min=1))
        hit = head.draft_to_target[logits.argmax(dim=-1)] == shifted(target_ids, 1 + step, n)
        correct.append((hit & mask).sum())
        count.append(rows)
    loss = torch.stack(losses)
    weights = torch.tensor(step_weights(num_steps, decay), device=loss.device)
    counts = StepCounts(loss.detach(), torch.stack(correct), torch.stack(count))
    return (loss * weights).sum(), counts


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
