"""torch.compile machinery: the attention op, the graph splitter, the piecewise backend, the
piece runners (CUDA graphs per token bucket) and the token buckets.
"""

from __future__ import annotations

from pcgspec.registry import lazy_exports

__all__ = [
    "CompiledDecoder",
    "PiecewiseBackend",
    "PiecewiseGraphs",
    "capture_buckets",
    "pad_to_bucket",
    "split_graph",
]

# NOTE: lazy, so importing pcgspec.compile.custom_ops (every model does) stays cheap.
__getattr__ = lazy_exports(
    __name__,
    {
        "CompiledDecoder": "pcgspec.compile.backend",
        "PiecewiseBackend": "pcgspec.compile.backend",
        "PiecewiseGraphs": "pcgspec.compile.piecewise",
        "capture_buckets": "pcgspec.compile.buckets",
        "pad_to_bucket": "pcgspec.compile.buckets",
        "split_graph": "pcgspec.compile.splitter",
    },
)
