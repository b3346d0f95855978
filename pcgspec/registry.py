"""A small name -> object registry with lazy imports."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to ``"module:attribute"`` paths, imported on first use.

    An unknown name raises ``ValueError`` listing every supported name.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._paths: dict[str, str] = {}
        self._loaded: dict[str, T] = {}

    def register(self, name: str, path: str) -> None:
        self._paths[name] = path

    def names(self) -> list[str]:
        return sorted(self._paths)

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def get(self, name: str) -> T:
        if name not in self._paths:
            raise ValueError(
                f"unsupported {self.kind} {name!r}; supported: {', '.join(self.names())}"
            )
        if name not in self._loaded:
            module, _, attr = self._paths[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports ``name`` from module ``where[name]`` on first use,
    so a package can re-export heavy pieces without importing them up front.
    """

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
