"""Model architectures, the architecture registry, and loading from HF folders or GGUF files."""

from __future__ import annotations

from pcgspec.models.registry import MODEL_REGISTRY, model_class
from pcgspec.registry import lazy_exports

__all__ = [
    "MODEL_REGISTRY",
    "convert_gguf",
    "default_model_path",
    "load_config",
    "load_model",
    "load_tokenizer",
    "model_class",
]

# NOTE: the loaders pull in transformers; import them only when asked for.
__getattr__ = lazy_exports(
    __name__,
    {
        "convert_gguf": "pcgspec.models.gguf",
        "default_model_path": "pcgspec.models.default_model",
        "load_config": "pcgspec.models.loader",
        "load_model": "pcgspec.models.loader",
        "load_tokenizer": "pcgspec.models.loader",
    },
)
