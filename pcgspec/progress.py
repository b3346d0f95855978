"""Progress bars on the waits a person sees (weight loading, compile, graph capture, training),
shown only where someone watches: when stderr is a terminal, or in a notebook. Logs, pipes and
CI get none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

__all__ = ["progress", "tqdm"]


def progress(iterable: Iterable[Any] | None = None, *, show: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar (``desc``, ``total``, ``unit`` ... as tqdm takes them) on stderr when it is a
    terminal (tqdm's ``disable=None``); ``show=False`` hides it everywhere.
    """
    return tqdm(iterable, disable=None if show else True, **kwargs)
