"""The project's scripts (``scripts/``) imported as modules, for their tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as module ``name`` (registered in ``sys.modules``: dataclasses
    look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """``load_script(name)``, dropped from ``sys.modules`` on leaving."""
    module = load_script(name)
    try:
        yield module
    finally:
        sys.modules.pop(name, None)
