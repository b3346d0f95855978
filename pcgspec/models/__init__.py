"""Model architectures, the architecture registry, and loading from HF folders or GGUF files."""

from __future__ import annotations

from pcgspec.models.registry import MODEL_REGISTRY, model_class

__all__ = [
    "MODEL_REGISTRY",
    "convert_gguf",
    "default_model_path",
    "load_config",
    "load_model",
    "load_tokenizer",
    "model_class",
]

_LAZY = {
    "convert_gguf": "pcgspec.models.gguf",
    "default_model_path": "pcgspec.models.default_model",
    "load_config": "pcgspec.models.loader",
    "load_model": "pcgspec.models.loader",
    "load_tokenizer": "pcgspec.models.loader",
}


def __getattr__(name: str) -> object:
    # NOTE: the loaders pull in transformers; import them only when asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pcgspec.models' has no attribute {name!r}")
