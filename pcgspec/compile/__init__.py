"""torch.compile machinery: the attention op, the graph splitter, the piecewise backend, the
piece runners (CUDA graphs per token bucket) and the token buckets.
"""

from __future__ import annotations

__all__ = [
    "CompiledDecoder",
    "PiecewiseBackend",
    "PiecewiseGraphs",
    "capture_buckets",
    "pad_to_bucket",
    "split_graph",
]

_LAZY = {
    "CompiledDecoder": "pcgspec.compile.backend",
    "PiecewiseBackend": "pcgspec.compile.backend",
    "PiecewiseGraphs": "pcgspec.compile.piecewise",
    "capture_buckets": "pcgspec.compile.buckets",
    "pad_to_bucket": "pcgspec.compile.buckets",
    "split_graph": "pcgspec.compile.splitter",
}


def __getattr__(name: str) -> object:
    # NOTE: lazy, so importing pcgspec.compile.custom_ops (every model does) stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pcgspec.compile' has no attribute {name!r}")
