"""The training loop: AdamW with linear warm-up and cosine decay, bf16 autocast on CUDA,
gradient clipping, a progress bar with loss and per-step accuracy, periodic evaluation on the
held-out split (whole, and the start of its chat-template responses), checkpoints and resume.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pcgspec.models.eagle3 import Eagle3Head
from pcgspec.progress import progress, tqdm
from pcgspec.training.data import batch_shape, iter_batches, plan_batches, split_shards
from pcgspec.training.loss import Batch, StepCounts, ttt_loss
from pcgspec.training.options import TrainOptions

logger = logging.getLogger("pcgspec")
KEEP_CHECKPOINTS = 2
REFIT_EVERY = 5  # steps between fits of the schedule to --max-train-seconds (no sync)
STEADY_AFTER = 10  # steps of a run before its seconds per step are measured (compilation)
CHAT_EVAL_TOKENS = 64  # scripts/bench_spec.py's chat set: 64 output tokens, chat template


@dataclass
class EvalResult:
    loss: float
    accuracy: list[float]  # per unrolled step
    accept_length: float  # estimated, chain over all unrolled steps
    accept_length_by_k: list[float]  # the same with k = 1, 2, ... drafts per step
    rows: int
    # the same over the first CHAT_EVAL_TOKENS response tokens of chat-template sequences only
    chat64: EvalResult | None = None

    @classmethod
    def from_counts(cls, loss: float, correct: torch.Tensor, count: torch.Tensor) -> EvalResult:
        acc = (correct.double() / count.double().clamp(min=1)).tolist()
        by_k = [accept_length_estimate(acc[:k]) for k in range(1, len(acc) + 1)]
        return cls(loss, acc, by_k[-1], by_k, int(count[0]))

    def as_dict(self) -> dict:
        """The numbers as JSON: ``chat64`` beside the whole split's, where there is one."""
        record = {k: v for k, v in asdict(self).items() if k != "chat64"}
        if self.chat64 is not None:
            record["chat64"] = self.chat64.as_dict()
        return record

    def message(self) -> str:
        text = (
            f"loss {self.loss:.3f}, accuracy "
            + "/".join(f"{a:.2f}" for a in self.accuracy)
            + f", estimated accept length {self.accept_length:.2f}"
        )
        window = f"; chat template, first {CHAT_EVAL_TOKENS} tokens:"
        if self.chat64 is None:
            return f"{text}{window} no such sequences"
        return f"{text}{window} {self.chat64.accept_length:.2f}"


class EvalSums:
    """Evaluation batches summed: loss, per-step correct and counted rows (on the device)."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self.loss, self.batches = 0.0, 0
        self.correct = torch.zeros(steps, device=device)
        self.count = torch.zeros(steps, device=device)

    def add(self, loss: torch.Tensor, counts: StepCounts) -> None:
        self.loss, self.batches = self.loss + float(loss), self.batches + 1
        self.correct += counts.correct
        self.count += counts.count

    def result(self) -> EvalResult | None:
        if not self.batches or not self.count.any():
            return None
        return EvalResult.from_counts(
            self.loss / self.batches, self.correct.cpu(), self.count.cpu()
        )


def accept_length_estimate(accuracy: list[float]) -> float:
    """``1 + sum_i prod_{j<=i} acc_j``: a chain accepts draft ``i`` only after all before it."""
    total, run = 1.0, 1.0
    for acc in accuracy:
        run *= acc
        total += run
    return total


def lr_lambda(warmup: int, total: Callable[[], int]) -> Callable[[int], float]:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total()`` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total() - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class Trainer:
    def __init__(
        self, head: Eagle3Head, opts: TrainOptions, data_dir: Path, index: dict, ckpt_dir: Path
    ) -> None:
        self.head, self.opts, self.data_dir, self.ckpt_dir = head, opts, data_dir, ckpt_dir
        self.index = index
        self.device = head.device
        self.train_shards = split_shards(index, "train")
        self.eval_shards = split_shards(index, "eval")
        if not self.train_shards:
            raise ValueError(f"{data_dir}: no training shards")
        # one shape for every batch, train and eval: a compiled loss compiles once per mode
        self.shape = batch_shape(index["shards"], opts.batch_tokens)
        self.compiled = opts.compile if opts.compile is not None else self.device.type == "cuda"
        self.steps_per_epoch = len(plan_batches(self.train_shards, self.shape, opts.seed))
        total = opts.epochs * self.steps_per_epoch
        self.total_steps = min(total, opts.max_steps) if opts.max_steps else total
        self.planned_steps = self.total_steps  # before any fit to --max-train-seconds
        params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay
        )
        warmup = max(1, round(opts.warmup_ratio * self.total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(warmup, lambda: self.total_steps)
        )
        self.step = 0
        self.evals: list[dict] = []

    def autocast(self) -> torch.autocast:
        cuda = self.device.type == "cuda"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda)

    def train(self) -> dict:
        """Run to ``total_steps`` (or the time limit); returns the run's numbers."""
        opts, start, first = self.opts, time.perf_counter(), self.step
        # (time, step) from which seconds per step are measured: past the first steps and the
        # first evaluation, which compile their graphs
        steady, evaluated = None, False
        bar = progress(total=self.total_steps, initial=self.step, desc="train", unit="step")
        sums = self._zero_sums()
        stopped = None
        while self.step < self.total_steps and stopped is None:
            epoch, skip = divmod(self.step, self.steps_per_epoch)
            plan = plan_batches(self.train_shards, self.shape, opts.seed + epoch)[skip:]
            batches = iter_batches(
                self.data_dir, self.index, self.train_shards, plan, self.shape, self.device
            )
            for batch in batches:
                self._train_step(batch, sums)
                bar.update(1)
                if self.step % opts.log_every == 0:
                    bar.set_postfix_str(self._postfix(sums))
                    sums = self._zero_sums()
                if opts.eval_every and self.step % opts.eval_every == 0:
                    self._record_eval(bar)
                    if not evaluated:
                        steady, evaluated = (time.perf_counter(), self.step), True
                if opts.save_every and self.step % opts.save_every == 0:
                    self.save()
                if self.step - first == STEADY_AFTER and steady is None:
                    steady = (time.perf_counter(), self.step)
                ran = self.step - first
                if opts.max_train_seconds and (ran == 1 or ran % REFIT_EVERY == 0):
                    # NOTE: from the first step on: a slow machine may reach the limit early
                    self._fit_to_time((start, first), steady, bar)
                if opts.max_train_seconds and time.perf_counter() - start > opts.max_train_seconds:
                    stopped = "max_train_seconds"
                if self.step >= self.total_steps or stopped:
                    break
        bar.close()
        final = self._record_eval(None)
        return {
            "steps": self.step,
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "stopped_by": stopped or "steps",
            "planned_steps": self.planned_steps,
            "train_s": time.perf_counter() - start,
            "final_eval": final,
            "evals": self.evals,
        }

    def _fit_to_time(
        self, begun: tuple[float, int], steady: tuple[float, int] | None, bar: tqdm
    ) -> None:
        """Set ``total_steps`` (at most the planned steps) so that the cosine decay ends when
        ``--max-train-seconds`` runs out (counted from ``begun``, ``(time, step)``), at the
        seconds per step measured since ``steady`` (evaluations and checkpoints included;
        before it, since ``begun``).
        """
        now = time.perf_counter()
        since = steady if steady is not None and self.step > steady[1] else begun
        per_step = (now - since[0]) / max(1, self.step - since[1])
        left = self.opts.max_train_seconds - (now - begun[0])
        fits = min(self.planned_steps, self.step + max(1, int(left / per_step)))
        if fits != self.total_steps:
            self.total_steps = fits
            bar.total = fits
            bar.refresh()

    def _train_step(self, batch, sums: list[torch.Tensor]) -> None:
        with self.autocast():
            loss, counts = ttt_loss(
                self.head, batch, self.opts.ttt_steps, self.opts.step_decay, self.compiled
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(
            self.optimizer.param_groups[0]["params"], self.opts.max_grad_norm
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        sums[0] += loss.detach()
        sums[1] += counts.correct
        sums[2] += counts.count
        sums[3] += 1

    def _zero_sums(self) -> list[torch.Tensor]:
        """Running loss sum, per-step correct and counted rows, steps (on the device)."""
        shapes = ((), (self.opts.ttt_steps,), (self.opts.ttt_steps,), ())
        return [torch.zeros(shape, device=self.device) for shape in shapes]

    def _postfix(self, sums: list[torch.Tensor]) -> str:
        loss, correct, count, num = (s.cpu() for s in sums)
        acc = "/".join(f"{a:.2f}" for a in (correct / count.clamp(min=1)).tolist())
        lr = self.scheduler.get_last_lr()[0]
        return f"loss={float(loss / num.clamp(min=1)):.3f} acc={acc} lr={lr:.2e}"

    @torch.no_grad()
    def evaluate(self) -> EvalResult | None:
        """Per-step accuracy and the estimated accept length on the held-out split, and the
        same (``chat64``) over the first ``CHAT_EVAL_TOKENS`` response tokens of its
        chat-template sequences: what ``scripts/bench_spec.py``'s chat set measures.
        """
        if not self.eval_shards:
            return None
        self.head.eval()
        whole, chat = (EvalSums(self.opts.ttt_steps, self.device) for _ in range(2))
        plan = plan_batches(self.eval_shards, self.shape, None)
        for batch in iter_batches(
            self.data_dir, self.index, self.eval_shards, plan, self.shape, self.device
        ):
            whole.add(*self._eval_loss(batch))
            chat.add(*self._eval_loss(batch.chat_window(CHAT_EVAL_TOKENS)))
        self.head.train()
        result = whole.result()
        if result is not None:
            result.chat64 = chat.result()
        return result

    def _eval_loss(self, batch: Batch) -> tuple[torch.Tensor, StepCounts]:
        with self.autocast():
            return ttt_loss(
                self.head, batch, self.opts.ttt_steps, self.opts.step_decay, self.compiled
            )

    def _record_eval(self, bar: tqdm | None) -> dict | None:
        result = self.evaluate()
        if result is None:
            return None
        record = {"step": self.step, **result.as_dict()}
        self.evals.append(record)
        message = f"eval step {self.step}: {result.message()}"
        (bar.write if bar is not None and not bar.disable else logger.info)(message)
        return record

    # checkpoints -----------------------------------------------------------------------------

    def save(self) -> Path:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = self.ckpt_dir / f"step-{self.step:08d}.pt"
        torch.save(
            {
                "step": self.step,
                "head": self.head.state_dict(),
                "draft_to_target": self.head.draft_to_target.cpu(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "evals": self.evals,
                "options": asdict(self.opts),
            },
            path.with_suffix(".tmp"),
        )
        path.with_suffix(".tmp").replace(path)
        for old in sorted(self.ckpt_dir.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
            old.unlink()
        return path

    def resume(self) -> int:
        """Load the latest checkpoint; returns its step (0: none found)."""
        found = latest_checkpoint(self.ckpt_dir)
        if found is None:
            logger.info("No checkpoint in %s: training from the start", self.ckpt_dir)
            return 0
        state = torch.load(found, map_location=self.device, weights_only=False)
        if not torch.equal(state["draft_to_target"].to(self.device), self.head.draft_to_target):
            raise ValueError(f"{found}: its draft vocabulary differs from this data's")
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.evals = state["step"], state["evals"]
        logger.info("Resumed from %s (step %d)", found, self.step)
        return self.step


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"))
    return found[-1] if found else None
