"""Counting Triton launches (tests and ``scripts/profile_step.py``): one place that knows both
ways a kernel is launched here, ``kernel[grid](...)`` and a compiled kernel reused directly.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from triton.compiler import CompiledKernel


@contextlib.contextmanager
def count_triton_launches() -> Iterator[collections.Counter[str]]:
    """Launches by kernel name while the block runs, compiled or interpreted."""
    from pcgspec.kernels import extend_attention

    kernel_type = type(extend_attention._extend_kernel)  # JITFunction or InterpretedFunction
    counts: collections.Counter[str] = collections.Counter()
    run, getitem = kernel_type.run, CompiledKernel.__getitem__

    def counting_run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counts[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    def counting_getitem(self, grid):  # noqa: ANN001, ANN202
        counts[self.name] += 1
        return getitem(self, grid)

    kernel_type.run, CompiledKernel.__getitem__ = counting_run, counting_getitem
    try:
        yield counts
    finally:
        kernel_type.run, CompiledKernel.__getitem__ = run, getitem
