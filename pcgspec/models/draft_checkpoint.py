"""Writing untrained checkpoints in published layouts, for tests and benchmarks: draft heads,
and targets of a named shape (``write_random_checkpoint``) that ``pcgspec serve`` can load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from pcgspec.models.random_weights import INIT_STD, shape_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

NORM_STD = 0.1  # norm weights are 1 + N(0, NORM_STD^2): distinct, so a swapped norm shows


# The files of a Hugging Face folder that make up its tokenizer (and its chat template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def random_tensors(
    shapes: Mapping[str, Sequence[int]],
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Tensors in ``shapes``' order, drawn in float32 and stored in ``dtype``: ``*norm.weight``
    near 1, the rest N(0, INIT_STD^2)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        noise = torch.randn(tuple(shape), generator=generator)
        value = 1.0 + NORM_STD * noise if name.endswith("norm.weight") else INIT_STD * noise
        tensors[name] = value.to(dtype)
    return tensors


def write_random_checkpoint(
    shape: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """A Hugging Face folder with random weights of the named ``shape`` (``SHAPES``).

    With ``tokenizer_dir`` its tokenizer files are copied in and the vocabulary (and the BOS /
    EOS ids) become the tokenizer's, so every sampled id decodes; the folder then serves alone.
    """
    config = shape_config(shape)
    if tokenizer_dir is not None:
        from pcgspec.models.loader import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        config.vocab_size = len(tokenizer)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    tensors = random_tensors(hf_tensor_shapes(config), generator, dtype)
    out = save_checkpoint(out_dir, config_dict(config), tensors)
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


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
