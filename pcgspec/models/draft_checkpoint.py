"""Writing untrained draft checkpoints in published layouts (for tests and benchmarks)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from pcgspec.models.random_weights import INIT_STD

if TYPE_CHECKING:
    from transformers import PretrainedConfig

NORM_STD = 0.1  # norm weights are 1 + N(0, NORM_STD^2): distinct, so a swapped norm shows


def random_tensors(
    shapes: Mapping[str, Sequence[int]], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """float32 tensors in ``shapes``' order: ``*norm.weight`` near 1, the rest N(0, INIT_STD^2)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        noise = torch.randn(tuple(shape), generator=generator)
        tensors[name] = 1.0 + NORM_STD * noise if name.endswith("norm.weight") else INIT_STD * noise
    return tensors


def hf_tensor_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the Hugging Face model for ``config`` (built on the meta
    device, so nothing is allocated); a tied ``lm_head.weight`` is left out as on disk.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def config_dict(config: PretrainedConfig) -> dict:
    """``config`` as the JSON object ``save_pretrained`` would write."""
    return json.loads(config.to_json_string(use_diff=True))


def save_checkpoint(out_dir: str | Path, config: dict, tensors: Mapping[str, torch.Tensor]) -> Path:
    """``config.json`` and one ``model.safetensors`` in ``out_dir`` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    save_file(contiguous, out / "model.safetensors", metadata={"format": "pt"})
    return out
