"""How compiled Triton kernels are launched here, and counting those launches (tests and
``scripts/profile_step.py``).

``compiled_launcher`` is Triton's own ``kernel[grid](*args)`` minus its per-launch Python, and
``CompiledLaunches`` keeps one per specialization of a kernel, so only the first launch of each
takes Triton's binder: a short prefill is host-bound, and the launches before the GPU has work
(and the attention launch of every layer) are on its critical path.

Two checks keep a lean launch from running the wrong binary. ``CompiledLaunches`` keys each
launch by everything Triton specializes it on (``launch_key``), taken from the arguments, so a
launch whose specialization differs from every cached one goes through Triton's own launch
(which compiles its binary) and is cached under its own key. And the lean path calls Triton
internals (``CompiledKernel.run``'s argument order, ``function``, ``packed_metadata``,
``_init_handles``, the launch hooks in ``knobs.runtime``, a JIT function's ``params``), so it
runs only on the Triton versions it was written and tested against (``LEAN_TRITON_VERSIONS``;
tests/test_lean_launches.py compares it with Triton's own launch on the GPU): on any other
every launch takes Triton's own path, and one warning says so.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import operator
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver

logger = logging.getLogger("pcgspec")
LEAN_TRITON_VERSIONS = ("3.6",)  # major.minor
_I32, _I64 = 1 << 31, 1 << 63
_counts: collections.Counter[str] | None = None  # set while count_triton_launches runs


def compiled_launcher(
    kernel: object, trailing: Sequence[object] = ()
) -> Callable[..., None] | None:
    """``launch(grid, *args)`` for ``kernel`` as Triton compiled it (what ``jit_fn[grid](...)``
    returns), or None when it is not a compiled kernel (the interpreter) or the installed
    Triton is not one of ``LEAN_TRITON_VERSIONS``.

    The arguments must match the specialization ``kernel`` was compiled for (pointer alignment,
    specialized ints); ``trailing`` is appended to every launch (the constexpr values, which
    the launcher takes positionally). Pointers may be passed as ints (``data_ptr()``): the
    launcher then skips its per-pointer ``cuPointerGetAttribute`` check, so the caller vouches
    for them. No launch-metadata dict is built and no hook is called while no launch hook is
    installed; with one (e.g. a profiler), every launch takes Triton's full path.
    """
    if not isinstance(kernel, CompiledKernel):
        return None
    if not lean_launches_supported():
        _warn_unsupported()
        return None
    kernel._init_handles()
    run, function, packed, name = kernel.run, kernel.function, kernel.packed_metadata, kernel.name
    active = driver.active
    current_device, current_stream = active.get_current_device, active.get_current_stream
    trailing = tuple(trailing)

    def launch(grid: tuple[int, int, int], *args: object) -> None:
        if _hooks_installed():
            kernel[grid](*args, *trailing)
            return
        if _counts is not None:
            _counts[name] += 1
        stream = current_stream(current_device())
        run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *args, *trailing)

    return launch


def lean_launches_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed Triton's) is one the lean path was written
    against."""
    version = triton.__version__ if version is None else version
    return ".".join(version.split("+")[0].split(".")[:2]) in LEAN_TRITON_VERSIONS


@functools.cache
def _warn_unsupported() -> None:
    logger.warning(
        "Triton %s is not a version pcgspec's lean kernel launches were written "
        "against (%s): every kernel launches through Triton's own path, which costs "
        "host time per launch",
        triton.__version__,
        ", ".join(LEAN_TRITON_VERSIONS),
    )


def scalar_key(value: object, specialized: bool) -> Hashable:
    """What Triton's signature and specialization see of a scalar argument: an int's type (i32,
    i64 or u64, by its value) and, where Triton specializes its value (``specialized``: not in
    the kernel's ``do_not_specialize``), whether it is 1 and whether 16 divides it; the type of
    anything else (float, bool, None).
    """
    if type(value) is not int:
        return type(value)
    width = 32 if -_I32 <= value < _I32 else 64 if -_I64 <= value < _I64 else 65
    return (width, value == 1, not value & 15) if specialized else width


class CompiledLaunches:
    """Launches of one ``@triton.jit`` kernel, each specialization's compiled kernel kept as a
    ``compiled_launcher`` after its first launch, under its ``launch_key``.

    Tensors come first in the argument list, then scalars, then the constexprs (by name in
    ``constants``, with launch options such as ``num_warps``). Pointers the kernel lists in
    ``do_not_specialize_on_alignment`` may have any alignment; a launch with another pointer
    not 16-byte aligned takes Triton's own path.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._launches: dict[Hashable, Callable[..., None] | None] = {}
        params = [p for p in getattr(fn, "params", ()) if not p.is_constexpr]  # NOTE: the
        # interpreter's functions have none: every scalar then counts as value-specialized
        self._align_checked = tuple(
            i for i, p in enumerate(params) if not p.do_not_specialize_on_alignment
        )
        self._value_specialized = tuple(not p.do_not_specialize for p in params)

    def aligned(self, ptrs: Sequence[int]) -> bool:
        """Whether the pointers (tensors' ``data_ptr()``, in argument order) that Triton
        specializes on alignment are all 16-byte aligned.
        """
        n = len(ptrs)
        return all_aligned([ptrs[i] for i in self._align_checked if i < n] or [0])

    def launch_key(
        self,
        tensors: Sequence[torch.Tensor],
        scalars: Sequence[object],
        constants: dict[str, object],
    ) -> Hashable:
        """Everything of an aligned launch that selects its compiled kernel: the device, the
        tensors' dtypes, each scalar's ``scalar_key`` and the constexprs and options."""
        flags = self._value_specialized[len(tensors) :] or itertools.repeat(True)
        values = [scalar_key(v, f) for v, f in zip(scalars, flags)]
        return (tensors[0].device, *[t.dtype for t in tensors], *values, *constants.items())

    def clear(self) -> None:
        """Forget the lean launches: the next launch of each specialization takes Triton's path."""
        self._launches.clear()

    def __call__(
        self,
        grid: tuple[int, int, int],
        tensors: Sequence[torch.Tensor],
        scalars: Sequence[object],
        constants: dict[str, object],
    ) -> Callable[..., None] | None:
        """Launch; returns the lean launch of this specialization (None: Triton's path only,
        e.g. under the interpreter, on another Triton version or with a misaligned pointer),
        which takes the same ``(grid, *tensors or data_ptrs, *scalars)``.
        """
        ptrs = [t.data_ptr() for t in tensors]
        if not self.aligned(ptrs):  # Triton specializes on alignment
            self.fn[grid](*tensors, *scalars, **constants)
            return None
        key = self.launch_key(tensors, scalars, constants)
        launch = self._launches.get(key)
        if launch is not None:
            launch(grid, *ptrs, *scalars)
            return launch
        kernel = self.fn[grid](*tensors, *scalars, **constants)
        names = self.fn.arg_names[len(tensors) + len(scalars) :]
        launch = compiled_launcher(kernel, [constants[name] for name in names])
        self._launches[key] = launch
        return launch


def all_aligned(ptrs: Sequence[int]) -> bool:
    """Whether every pointer is 16-byte aligned (what Triton specializes pointers on)."""
    return not functools.reduce(operator.or_, ptrs) & 15


def _hooks_installed() -> bool:
    """Whether a Triton launch hook is set (None or an empty HookChain: none)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook) for hook in hooks)


@contextlib.contextmanager
def count_triton_launches() -> Iterator[collections.Counter[str]]:
    """Launches by kernel name while the block runs, compiled or interpreted, through any of
    the three ways a kernel is launched here: ``jit_fn[grid](...)``, ``compiled[grid](...)``
    and a ``compiled_launcher``.
    """
    global _counts
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
    _counts = counts
    try:
        yield counts
    finally:
        kernel_type.run, CompiledKernel.__getitem__ = run, getitem
        _counts = None
