"""A small name -> object registry with lazy imports."""

from __future__ import annotations

import importlib
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
