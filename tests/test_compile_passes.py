"""Inductor graph passes of the compiled pieces (``pcgspec/compile/passes.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from pcgspec.compile.passes import inductor_patches


def _layer(x, h, w1, w2, b):  # noqa: ANN001, ANN202
    """Two residual adds after GEMMs (a decoder layer's), and a linear layer with a bias row."""
    a = h + F.linear(x, w1)
    normed = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5)
    return a + F.linear(normed, w2), F.linear(normed, w2, b)


def _scaled(x, h, w1, w2, b):  # noqa: ANN001, ANN202
    """``addmm`` with ``beta`` / ``alpha``: not a residual add to split."""
    return (torch.addmm(h, x, w1, beta=0.5, alpha=2.0),)


def _compiled_code(fn, options: dict[str, object]) -> str:  # noqa: ANN001
    """Inductor's code for ``fn`` with ``options``; its outputs checked against eager's."""
    torch.manual_seed(0)
    args = (torch.randn(8, 32), torch.randn(8, 32), torch.randn(32, 32), torch.randn(32, 32))
    args = (*args, torch.randn(32))
    torch._dynamo.reset()
    compiled = torch.compile(fn, options=options, dynamic=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out, code = run_and_get_code(compiled, *args)
    for got, want in zip(out, fn(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return "\n".join(code)


def test_residual_adds_stay_a_gemm_and_an_add():
    """Inductor alone makes an ``addmm`` of each of the three (on CUDA a whole-matrix input is
    copied into the output first); with the pass the residual adds are GEMMs and adds, and the
    bias row stays in its ``addmm``."""
    fused = _compiled_code(_layer, {})
    assert fused.count("extern_kernels.addmm(") == 3
    assert "extern_kernels.mm(" not in fused
    unfused = _compiled_code(_layer, inductor_patches())
    assert unfused.count("extern_kernels.addmm(") == 1
    assert unfused.count("extern_kernels.mm(") == 2


def test_a_scaled_addmm_is_left_alone():
    """``beta`` / ``alpha`` stay in their ``addmm`` (eager's outputs checked)."""
    code = _compiled_code(_scaled, inductor_patches())
    assert code.count("extern_kernels.addmm(") == 1
