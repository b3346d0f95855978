"""What EAGLE3 and MTP draft heads share: the ``DraftHead`` contract the proposers call, the
target modules a head borrows, and checkpoint helpers (tensor names, selective reads).

A head owns ``num_layers`` (1) KV-cache layers of its own: its attention calls
``torch.ops.pcgspec.attention(..., layer_id)`` with ids ``0..num_layers-1``, and the caller runs it
inside a ``forward_context`` whose backend holds the draft's KV cache.

Pairing convention: row ``t`` pairs the target hidden state of position ``p`` with the token at
``p + 1``, at position ``p``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from pcgspec.models.layers.rotary import RotaryEmbedding, rope_parameters
from pcgspec.models.layers.weights import PackedMapping, checkpoint_parameter_names
from pcgspec.models.llama import LlamaForCausalLM, head_dim_of
from pcgspec.speculative.tree import top_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HeadT = TypeVar("HeadT", bound="DraftHead")


@dataclass(frozen=True)
class SharedModules:
    """Target modules a head uses without owning them (not registered as submodules, so the
    head's ``named_parameters``, ``to`` and ``state_dict`` leave them alone).
    """

    embed_tokens: nn.Module  # [V, H_target]
    lm_head: nn.Module  # weight [V, H_target]


class DraftHead(nn.Module, ABC):
    """One-layer draft model over the target's hidden states (EAGLE3, NEXTN/MTP)."""

    num_layers: int = 1
    uses_target_hidden: bool = True  # the first draft step reads the target's hidden states
    packed_modules_mapping: ClassVar[PackedMapping] = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: PretrainedConfig, target: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = head_dim_of(config)
        self.attn_scale: float = self.head_dim**-0.5
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = target.vocab_size
        self.target_hidden_size: int = target.hidden_size
        self.shared = SharedModules(target.model.embed_tokens, target.lm_head)
        self.rotary_emb = RotaryEmbedding(self.head_dim, rope_parameters(config))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @abstractmethod
    def target_aux_layers(self, target_num_layers: int) -> tuple[int, ...] | None:
        """Layers whose residual-stream inputs the target must capture (``L`` = the final
        pre-norm stream, as ``LlamaModel.set_aux_hidden_layers`` reads ids), or ``None``: the
        target's final normed hidden state.
        """

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        hidden: torch.Tensor,  # [T, target_hidden_size] from the target, or [T, H] own
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits_hidden [T, H], next_hidden [T, H])``; ``next_hidden`` feeds the next
        draft step as ``hidden``.
        """

    @abstractmethod
    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        """``[R, H] -> [R, vocab_size]`` float32 over the target vocabulary."""

    def top_tokens(self, logits_hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, H] -> ([R, k], [R, k])``: each row's ``k`` best draft tokens (target ids) and
        their log-probabilities (``speculative.tree.top_tokens``)."""
        return top_tokens(self.compute_logits(logits_hidden), k)

    def checkpoint_names(self) -> dict[str, str]:
        """Checkpoint tensor name -> the (unfused) name ``load_named_weights`` takes."""
        names = checkpoint_parameter_names(self, self.packed_modules_mapping)
        return {name: name for name in names}


def build_head(
    factory: Callable[[], HeadT], dtype: torch.dtype, device: torch.device | str
) -> HeadT:
    """``factory()`` built on the meta device, then allocated (uninitialized) in ``dtype``."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    with torch.device("meta"):
        head = factory()
    return head.to(dtype=dtype).to_empty(device=device)


def finish_loading(head: DraftHead) -> None:
    """After the weights landed: RoPE tables in float32, eval mode, no gradients."""
    head.rotary_emb.init_rope()
    head.requires_grad_(False).eval()


def check_tensor_names(
    provided: Iterable[str], expected: Iterable[str], where: str, optional: Iterable[str] = ()
) -> None:
    """``ValueError`` naming every tensor ``where`` has but the head does not take, or lacks."""
    provided, expected = set(provided), set(expected)
    extra = sorted(provided - expected - set(optional))
    if extra:
        raise ValueError(f"{where}: unexpected tensors {extra[:20]}")
    missing = sorted(expected - provided)
    if missing:
        raise ValueError(f"{where}: {len(missing)} tensors missing: {missing[:20]}")


def tensor_names(files: Sequence[Path]) -> dict[str, Path]:
    """Every tensor name of the shards -> its file, without reading any tensor."""
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def read_tensors(
    where: Mapping[str, Path], names: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for ``names`` only, on the CPU (the rest of a large target checkpoint
    stays on disk).
    """
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(where[name], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in file_names:
                yield name, f.get_tensor(name)
