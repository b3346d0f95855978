"""Captured training data on disk: shards of sequences (safetensors) and a JSON index.

A shard holds its sequences concatenated: ``input_ids [N]`` int32, ``loss_mask [N]`` uint8
(response tokens), ``aux [N, 3H]`` and ``final [N, H]`` bfloat16 (the target's aux states and its
final normed hidden state), ``offsets [S + 1]`` int64. ``index.json`` lists the shards with
their split, sequence lengths (enough to plan batches without opening a shard) and whether each
sequence went through the chat template, and the metadata of the run (target, aux layers,
prompt sources, sampling).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pcgspec.training.loss import Batch

INDEX_FILE = "index.json"
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

    def add(self, ids: Sequence[int], mask: Sequence[bool], aux: torch.Tensor,
            final: torch.Tensor, chat: bool) -> None:  # fmt: skip
        if not len(ids) == len(mask) == len(aux) == len(final):
            raise ValueError(f"sequence parts differ in length: {len(ids)} ids, {len(mask)} mask, "
                             f"{len(aux)} aux, {len(final)} final")  # fmt: skip
        bf16 = torch.bfloat16
        self._seqs.append((torch.tensor(ids, dtype=torch.int32),
                           torch.tensor(mask, dtype=torch.uint8),
                           aux.to(bf16).cpu(), final.to(bf16).cpu()))  # fmt: skip
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
        save_file({"input_ids": ids, "loss_mask": mask, "aux": aux, "final": final,
                   "offsets": offsets}, self.out_dir / name)  # fmt: skip
        self.shards.append({"file": name, "split": self.split, "lengths": lengths,
                            "response_tokens": int(mask.sum()), "chat": self._chat})  # fmt: skip
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
        sizes[split] = {"sequences": sum(len(s["lengths"]) for s in shards),
                        "tokens": sum(sum(s["lengths"]) for s in shards),
                        "response_tokens": sum(s["response_tokens"] for s in shards)}  # fmt: skip
    return sizes


def plan_batches(
    shards: Sequence[dict], batch_tokens: int, seed: int | None
) -> list[tuple[int, list[int]]]:
    """``(shard index, sequence indices)`` per batch: within a shard, sequences of similar
    length share a batch of at most ``batch_tokens`` padded tokens (one sequence at least);
    ``seed`` shuffles shards, sequences and batches (None: file order, for evaluation).
    """
    rng = random.Random(seed)
    order = list(range(len(shards)))
    if seed is not None:
        rng.shuffle(order)
    plan: list[tuple[int, list[int]]] = []
    for s in order:
        lengths = shards[s]["lengths"]
        seqs = list(range(len(lengths)))
        if seed is not None:
            rng.shuffle(seqs)  # NOTE: ties in length land in a random batch
        seqs.sort(key=lambda i: lengths[i])
        batches: list[list[int]] = []
        for i in seqs:
            current = batches[-1] if batches else None
            if current and (len(current) + 1) * lengths[i] <= batch_tokens:
                current.append(i)
            else:
                batches.append([i])
        if seed is not None:
            rng.shuffle(batches)
        plan += [(s, b) for b in batches]
    return plan


def iter_batches(
    data_dir: Path, shards: Sequence[dict], plan: Sequence[tuple[int, list[int]]],
    device: torch.device,
) -> Iterator[Batch]:  # fmt: skip
    """The planned batches, padded, on ``device``; one shard in memory at a time."""
    loaded, tensors = -1, {}
    for shard, seqs in plan:
        if shard != loaded:
            tensors, loaded = load_file(data_dir / shards[shard]["file"]), shard
        yield make_batch(tensors, seqs, device)


def make_batch(
    tensors: dict[str, torch.Tensor], seqs: Sequence[int], device: torch.device
) -> Batch:
    offsets = tensors["offsets"].tolist()
    spans = [(offsets[i], offsets[i + 1]) for i in seqs]
    longest = max(end - start for start, end in spans)

    def padded(name: str) -> torch.Tensor:
        src = tensors[name]
        out = src.new_zeros((len(spans), longest, *src.shape[1:]))
        for row, (start, end) in enumerate(spans):
            out[row, : end - start] = src[start:end]
        return out.to(device, non_blocking=True)

    return Batch(padded("input_ids").long(), padded("loss_mask").bool(), padded("aux"),
                 padded("final"))  # fmt: skip


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
