"""Load Hugging Face named tensors into a model whose linears may fuse several HF projections."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from pcgspec.models.layers.linear import default_weight_loader

# HF module name -> (our fused module name, shard index), e.g. "k_proj" -> ("qkv_proj", 1)
PackedMapping = Mapping[str, tuple[str, int]]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: PackedMapping,
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy every ``(hf_name, tensor)`` into ``model``; each parameter's owning module may define
    ``weight_loader(param, tensor, shard_id)`` for fused shards, or ``weight_loader(param,
    tensor)`` to take its tensor-parallel slice of a whole one.

    Raises ``ValueError`` on a name the model does not have, on a shape mismatch, and, at the
    end, on parameters (or shards of fused ones) that no tensor filled.
    """
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    with torch.no_grad():
        for hf_name, tensor in weights:
            if skip(hf_name):
                continue
            name, shard_id = _packed_name(hf_name, packed_modules_mapping)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(model).__name__}")
            try:
                _load_one(model, name, params[name], tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"cannot load {hf_name!r}: {e}") from None
            loaded.add((name, shard_id))
    missing = sorted(
        _hf_name(n, s, packed_modules_mapping) for n, s in _required(model) if (n, s) not in loaded
    )
    if missing:
        raise ValueError(f"{len(missing)} parameters missing from the checkpoint: {missing[:20]}")


def checkpoint_parameter_names(model: nn.Module, mapping: PackedMapping) -> list[str]:
    """The checkpoint names ``load_named_weights`` fills ``model`` from, in parameter order:
    every fused projection split back into its parts (``qkv_proj`` -> ``q_proj``, ...).
    """
    return [_hf_name(name, shard, mapping) for name, shard in _required(model)]


def unfused_state_dict(model: nn.Module, mapping: PackedMapping) -> dict[str, torch.Tensor]:
    """``model``'s parameters under their checkpoint names, fused projections split back into
    their parts: what ``load_named_weights`` reads back (detached views, no copies).
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        sizes = getattr(module, "output_sizes", None)
        if not sizes:
            out[name] = param.detach()
            continue
        for shard, part in enumerate(param.detach().split(list(sizes), dim=0)):
            out[_hf_name(name, shard, mapping)] = part
    return out


def _packed_name(hf_name: str, mapping: PackedMapping) -> tuple[str, int | None]:
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in mapping:
            fused, shard_id = mapping[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return hf_name, None


def _hf_name(name: str, shard_id: int | None, mapping: PackedMapping) -> str:
    if shard_id is None:
        return name
    parts = name.split(".")
    for hf_part, (fused, shard) in mapping.items():
        if shard == shard_id and fused in parts:
            i = parts.index(fused)
            return ".".join([*parts[:i], hf_part, *parts[i + 1 :]])
    return f"{name}[shard {shard_id}]"


def _load_one(
    model: nn.Module, name: str, param: torch.Tensor, tensor: torch.Tensor, shard_id: int | None
) -> None:
    module = model.get_submodule(name.rpartition(".")[0])
    loader = getattr(module, "weight_loader", None)
    if shard_id is not None:
        if loader is None:
            raise ValueError(f"{type(module).__name__} has no weight_loader for shard {shard_id}")
        loader(param, tensor, shard_id)
    elif hasattr(module, "output_sizes"):
        raise ValueError(f"{name} is fused; load its shards, not the whole tensor")
    elif loader is not None:
        loader(param, tensor)
    else:
        default_weight_loader(param, tensor)


def _required(model: nn.Module) -> list[tuple[str, int | None]]:
    """Every (parameter, shard) a checkpoint must fill, in parameter order."""
    required: list[tuple[str, int | None]] = []
    for name, _ in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        shards = getattr(module, "output_sizes", None)
        required += [(name, i) for i in range(len(shards))] if shards else [(name, None)]
    return required
