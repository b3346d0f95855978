"""Convert a llama.cpp ``.gguf`` file into a Hugging Face folder (float32 safetensors)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, stop_tokens: Sequence[str] = ()
) -> Path:
    """Dequantize ``gguf_path`` with transformers and write config, weights, tokenizer and
    generation config to ``out_dir``; ``stop_tokens`` (e.g. ``<|im_end|>``), when given, become
    the model's ``eos_token_id`` list.

    The folder appears atomically (written next to it, then renamed), so a crash leaves no
    half-converted model and concurrent conversions of the same file are harmless.
    """
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s to %s (dequantizing to float32) ...", gguf_path, out_dir)
    start = time.perf_counter()
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_hf_folder(gguf_path, tmp_dir, stop_tokens)
        _publish(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return out_dir


def _write_hf_folder(gguf_path: Path, out_dir: Path, stop_tokens: Sequence[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # NOTE: transformers dequantizes and undoes llama.cpp's q/k row permutation; its
    # save_pretrained refuses GGUF-loaded models, so the pieces are written by hand.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if stop_tokens:
        ids = _token_ids(tokenizer, stop_tokens)
        model.config.eos_token_id = model.generation_config.eos_token_id = ids
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        key: tensor.contiguous()
        for key, tensor in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {
        key: value
        for key, value in model.config.to_dict().items()
        if key != "quantization_config" and not key.startswith("_")  # e.g. the temp folder
    }
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _token_ids(tokenizer: object, tokens: Sequence[str]) -> list[int]:
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"stop_tokens {missing} are not in the GGUF file's vocabulary")
    return [vocab[t] for t in tokens]


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    # NOTE: mkdtemp makes the folder private; the cache may be shared.
    for file in tmp_dir.iterdir():
        file.chmod(0o644)
    tmp_dir.chmod(0o755)
    try:
        tmp_dir.rename(out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        logger.info("%s was converted concurrently by another process; using it", out_dir)
