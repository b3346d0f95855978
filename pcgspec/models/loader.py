"""Load a model (and its tokenizer) from a Hugging Face folder or a ``.gguf`` file."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from pcgspec import envs
from pcgspec.config import check_not_hub_id
from pcgspec.distributed.group import SINGLE, TPGroup
from pcgspec.models.registry import MODEL_REGISTRY, MODEL_TYPE_ALIASES, model_class
from pcgspec.progress import progress

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


def resolve_model_dir(path: str | Path | None) -> Path:
    """The Hugging Face folder for ``path``; a ``.gguf`` file is converted once into
    ``cache_dir()/models/<stem>``; a model name (``pcgspec models`` lists them) is fetched and
    converted once into ``cache_dir()/models/<folder>``; ``None`` is the embedded default model.
    """
    if path is None:
        from pcgspec.models.default_model import default_model_path

        return default_model_path()
    check_not_hub_id("model", str(path))
    if not Path(path).expanduser().exists():
        return _named_model_dir(str(path))
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model path {str(path)!r} is a file but not a .gguf file")
        return _converted_gguf(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in model folder {str(path)!r}")
    return path


def _named_model_dir(name: str) -> Path:
    from pcgspec.models.catalog import find_model, model_names
    from pcgspec.models.fetch import named_model_path

    source = find_model(name)
    if source is None:
        raise FileNotFoundError(
            f"model path {name!r} does not exist (expected a Hugging Face folder with "
            f"{CONFIG_FILE} and *.safetensors, a .gguf file, or a model name: "
            f"{', '.join(model_names())})"
        )
    if source.architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"model {source.name!r} is a {source.architecture}, which pcgspec does not run; "
            f"supported architectures: {', '.join(MODEL_REGISTRY.names())}"
        )
    return named_model_path(source)


def _converted_gguf(gguf_path: Path) -> Path:
    from pcgspec.models.gguf import convert_gguf

    out_dir = envs.cache_dir() / "models" / gguf_path.stem
    if (out_dir / CONFIG_FILE).is_file():
        logger.info("Using %s, converted earlier from %s", out_dir, gguf_path)
        return out_dir
    return convert_gguf(gguf_path, out_dir)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those the index names, else every ``*.safetensors``."""
    index = folder / WEIGHTS_INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards missing from {folder}: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no weights in model folder {str(folder)!r}: looked for {WEIGHTS_INDEX_FILE} "
            "and *.safetensors"
        )
    return files


def iter_safetensors(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the shards, on the CPU, with a progress bar."""
    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with progress(total=total, desc="Loading weights", unit="tensor") as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update()


def load_config(path: str | Path) -> PretrainedConfig:
    from transformers import AutoConfig

    folder = resolve_model_dir(path)
    fields = json.loads((folder / CONFIG_FILE).read_text())
    alias = MODEL_TYPE_ALIASES.get(fields.pop("model_type", None))
    if alias is None:
        return AutoConfig.from_pretrained(folder)
    return AutoConfig.for_model(alias, **fields)


def context_length(requested: int | None, hf_config: PretrainedConfig) -> int:
    """``requested`` (None: the model's ``max_position_embeddings``); above the model's
    maximum raises ``ValueError`` naming both.
    """
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: pass context_length")
        return limit
    if limit is not None and requested > limit:
        raise ValueError(
            f"context_length {requested} exceeds the model's maximum "
            f"(max_position_embeddings = {limit}); use at most {limit}"
        )
    return requested


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, tp: TPGroup = SINGLE
) -> nn.Module:
    """Build the model for ``path``'s architecture on the meta device, allocate it on ``device``
    in ``dtype``, and load every weight (with ``tp`` of several ranks, this rank's shard only).
    Returned in eval mode without gradients.
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    start = time.perf_counter()
    folder = resolve_model_dir(path)
    config = load_config(folder)
    cls = model_class(config)
    files = safetensors_files(folder)
    with torch.device("meta"):
        model = cls(config, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.load_weights(iter_safetensors(files))
    model.requires_grad_(False).eval()
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    what = f"{cls.__name__} ({millions:.1f}M params, {dtype}, tp rank {tp.rank}/{tp.size})"
    logger.info("Loaded %s from %s in %.1f s", what, folder, time.perf_counter() - start)
    return model


def load_vocab_modules(
    path: str | Path, dtype: torch.dtype, device: torch.device | str
) -> nn.Module:
    """``path``'s model for one rank with only its embedding and LM head allocated and loaded
    (every other parameter stays on the meta device): what a draft head borrows from a target
    that tensor parallelism shards, since the sharded ones need every rank to run them.
    """
    folder = resolve_model_dir(path)
    config = load_config(folder)
    with torch.device("meta"):
        model = model_class(config)(config, SINGLE)
    parts = {"model.embed_tokens.weight": model.model.embed_tokens}
    if model.lm_head is not model.model.embed_tokens:
        parts["lm_head.weight"] = model.lm_head
    for module in parts.values():
        module.to(dtype=dtype).to_empty(device=device)
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in parts.keys() & set(f.keys()):
                parts.pop(name).weight.data.copy_(f.get_tensor(name))
    if parts:
        raise ValueError(f"model folder {str(folder)!r} lacks {sorted(parts)}")
    return model.requires_grad_(False).eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of ``path`` (with its chat template)."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(path))
    logger.info("Loaded tokenizer in %.1f s", time.perf_counter() - start)
    return tokenizer
