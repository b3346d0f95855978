"""Captured training data on disk: shards of sequences (safetensors) and a JSON index.

A shard holds its sequences concatenated: ``input_ids [N]`` int32, ``loss_mask [N]`` uint8
(response tokens), ``aux [N, 3H]`` and ``final [N, H]`` bfloat16 (the target's aux states and its
final normed hidden state), ``offsets [S + 1]`` int64. ``index.json`` lists the shards with
their split, sequence lengths (enough to plan batches without opening a shard) and whether each
sequence went through the chat template, and the metadata of the run (target, aux layers,
prompt sources, sampling).

Training batches all have one shape (``batch_shape``): whole sequences of a shard packed best fit
into lines as long as the longest sequence (``plan_batches``), so a compiled loss compiles once.
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pcgspec.training.loss import Batch

INDEX_FILE = "index.json"
LINE_MULTIPLE = 64  # a batch line's length is a multiple of this
SPLITS = ("train", "eval")


@dataclass
class ShardWriter:
    """Collects sequences of one split and writes a shard every ``shard_tokens`` tokens."""

    out_dir: Path
    split: str
    shard_tokens: int
    shards: list[dict] = field(default_factory=list)
    _seqs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    _chat: list[bool] = field(default_factory=list)

    def add(
        self,
        ids: Sequence[int],
        mask: Sequence[bool],
        aux: torch.Tensor,
        final: torch.Tensor,
        chat: bool,
    ) -> None:
        if not len(ids) == len(mask) == len(aux) == len(final):
            raise ValueError(
                f"sequence parts differ in length: {len(ids)} ids, {len(mask)} mask, "
                f"{len(aux)} aux, {len(final)} final"
            )
        bf16 = torch.bfloat16
        self._seqs.append(
            (
                torch.tensor(ids, dtype=torch.int32),
                torch.tensor(mask, dtype=torch.uint8),
                aux.to(bf16).cpu(),
                final.to(bf16).cpu(),
            )
        )
        self._chat.append(chat)
        if sum(len(s[0]) for s in self._seqs) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._seqs:
            return
        ids, mask, aux, final = (torch.cat(parts) for parts in zip(*self._seqs))
        lengths = [len(s[0]) for s in self._seqs]
        offsets = torch.tensor([0, *lengths]).cumsum(0)
        name = f"{self.split}-{len(self.shards):05d}.safetensors"
        save_file(
            {"input_ids": ids, "loss_mask": mask, "aux": aux, "final": final, "offsets": offsets},
            self.out_dir / name,
        )
        self.shards.append(
            {
                "file": name,
                "split": self.split,
                "lengths": lengths,
                "response_tokens": int(mask.sum()),
                "chat": self._chat,
            }
        )
        self._seqs, self._chat = [], []


def write_index(data_dir: Path, shards: Sequence[dict], metadata: dict) -> Path:
    path = data_dir / INDEX_FILE
    path.write_text(json.dumps({"metadata": metadata, "shards": list(shards)}, indent=1) + "\n")
    return path


def read_index(data_dir: Path) -> dict:
    path = data_dir / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {INDEX_FILE} in {data_dir}: run the generate phase first")
    return json.loads(path.read_text())


def split_shards(index: dict, split: str) -> list[dict]:
    return [s for s in index["shards"] if s["split"] == split]


def chat_flags(index: dict, shard: dict) -> list[bool]:
    """Per sequence of ``shard``: did its prompt go through the chat template? (Data written
    before the flags were recorded: all did if no prompt was raw, else none is known to.)
    """
    if "chat" in shard:
        return shard["chat"]
    raw = index["metadata"].get("prompts", {}).get("without_chat_template")
    return [raw == 0] * len(shard["lengths"])


def split_sizes(index: dict) -> dict[str, dict[str, int]]:
    """Sequences, tokens and response tokens per split."""
    sizes = {}
    for split in SPLITS:
        shards = split_shards(index, split)
        sizes[split] = {
            "sequences": sum(len(s["lengths"]) for s in shards),
            "tokens": sum(sum(s["lengths"]) for s in shards),
            "response_tokens": sum(s["response_tokens"] for s in shards),
        }
    return sizes


class BatchShape(NamedTuple):
    """Every batch's shape: ``lines`` lines of ``line_tokens`` tokens."""

    lines: int
    line_tokens: int


def batch_shape(shards: Sequence[dict], batch_tokens: int) -> BatchShape:
    """A line holds the longest sequence of ``shards`` (rounded up to a multiple of
    ``LINE_MULTIPLE``); a batch holds ``batch_tokens // line_tokens`` lines, one at least.
    """
    longest = max(max(s["lengths"], default=1) for s in shards)
    line_tokens = -(-longest // LINE_MULTIPLE) * LINE_MULTIPLE
    return BatchShape(max(1, batch_tokens // line_tokens), line_tokens)


def pack(lengths: Sequence[int], line_tokens: int, rng: random.Random | None) -> list[list[int]]:
    """Sequence indices per line, packed best fit, longest first (ties in ``rng``'s order)."""
    order = list(range(len(lengths)))
    if rng is not None:
        rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])
    lines: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, line), sorted
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            lines.append([i])
            left, line = line_tokens - lengths[i], len(lines) - 1
        else:
            left, line = room.pop(at)
            lines[line].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(room, (left, line))
    return lines


def plan_batches(
    shards: Sequence[dict], shape: BatchShape, seed: int | None
) -> list[tuple[int, list[list[int]]]]:
    """``(shard index, sequence indices per line)`` per batch of ``shape`` (a shard's last
    batch filled up with empty lines); ``seed`` shuffles shards, sequences and lines (None:
    file order, for evaluation).
    """
    rng = random.Random(seed) if seed is not None else None
    order = list(range(len(shards)))
    if rng is not None:
        rng.shuffle(order)
    plan: list[tuple[int, list[list[int]]]] = []
    for s in order:
        lines = pack(shards[s]["lengths"], shape.line_tokens, rng)
        if rng is not None:
            rng.shuffle(lines)
        for first in range(0, len(lines), shape.lines):
            batch = lines[first : first + shape.lines]
            plan.append((s, batch + [[] for _ in range(shape.lines - len(batch))]))
    return plan


def iter_batches(
    data_dir: Path,
    index: dict,
    shards: Sequence[dict],
    plan: Sequence[tuple[int, list[list[int]]]],
    shape: BatchShape,
    device: torch.device,
) -> Iterator[Batch]:
    """The planned batches on ``device``; one shard in memory at a time."""
    loaded, tensors, chat = -1, {}, []
    for shard, lines in plan:
        if shard != loaded:
            tensors, loaded = load_file(data_dir / shards[shard]["file"]), shard
            chat = chat_flags(index, shards[shard])
        yield make_batch(tensors, chat, lines, shape.line_tokens, device)


def make_batch(
    tensors: dict[str, torch.Tensor],
    chat: Sequence[bool],
    lines: Sequence[Sequence[int]],
    line_tokens: int,
    device: torch.device,
) -> Batch:
    """The sequences ``lines`` names, each line's one after another, then padding. For CUDA
    it is built in pinned memory, so the copy to the device does not wait for the step before.
    """
    offsets = tensors["offsets"].tolist()
    shape = (len(lines), line_tokens)
    pin = device.type == "cuda"

    def empty(dtype: torch.dtype, *inner: int, fill: int = 0) -> torch.Tensor:
        return torch.full((*shape, *inner), fill, dtype=dtype, pin_memory=pin)

    parts = {
        name: empty(tensors[name].dtype, *tensors[name].shape[1:])
        for name in ("input_ids", "loss_mask", "aux", "final")
    }
    seq = empty(torch.long, fill=-1)
    positions = empty(torch.long)
    is_chat = empty(torch.bool)
    for b, line in enumerate(lines):
        at = 0
        for k, i in enumerate(line):
            start, end = offsets[i], offsets[i + 1]
            span = slice(at, at + end - start)
            for name, out in parts.items():
                out[b, span] = tensors[name][start:end]
            seq[b, span] = k
            positions[b, span] = torch.arange(end - start)
            is_chat[b, span] = chat[i]
            at = span.stop

    def moved(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return Batch(
        moved(parts["input_ids"]).long(),
        moved(parts["loss_mask"]).bool(),
        moved(parts["aux"]),
        moved(parts["final"]),
        moved(seq),
        moved(positions),
        moved(is_chat),
    )


def draft_vocabulary(data_dir: Path, index: dict, size: int, vocab_size: int) -> torch.Tensor:
    """``[size]`` sorted target ids: the most frequent tokens of the training responses (ties
    and the rest by frequency over whole sequences, then by id).
    """
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {size}")
    response = torch.zeros(vocab_size, dtype=torch.int64)
    overall = torch.zeros(vocab_size, dtype=torch.int64)
    for shard in split_shards(index, "train"):
        with safe_open(data_dir / shard["file"], framework="pt") as f:
            ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
        response += torch.bincount(ids[mask], minlength=vocab_size)
        overall += torch.bincount(ids, minlength=vocab_size)
    key = response * (int(overall.sum()) + 1) + overall
    order = torch.sort(key, descending=True, stable=True).indices
    return order[:size].sort().values
