"""Lean kernel launches (``pcgspec/kernels/launches.py``) run a cached binary only for a launch
of the same specialization, only on the Triton versions they were written against, and on the
GPU give every lean-launched kernel's outputs bit for bit as Triton's own launch does.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import triton
from triton.compiler import CompiledKernel

from pcgspec.kernels import launches
from pcgspec.kernels.launches import CompiledLaunches, lean_launches_supported, scalar_key


@pytest.mark.parametrize(
    ("version", "lean"),
    [
        ("3.6.0", True),
        ("3.6.1+git9a8b", True),
        ("3.5.1", False),
        ("3.9.0", False),
        ("4.0.0", False),
    ],
)
def test_the_version_gate(version, lean):
    assert lean_launches_supported(version) is lean


@pytest.mark.parametrize(
    ("value", "specialized", "key"),
    [
        (32, True, (32, False, True)),
        (33, True, (32, False, False)),
        (1, True, (32, True, False)),
        (-16, True, (32, False, True)),
        (2**31, True, (64, False, True)),
        (2**31, False, 64),
        (-(2**31), False, 32),
        (2**63, False, 65),
        (7, False, 32),
        (0.5, True, float),
        (True, True, bool),
        (None, False, type(None)),
    ],
)
def test_scalar_key_is_what_triton_specializes(value, specialized, key):
    assert scalar_key(value, specialized) == key


# --- the fallback logic, with a stand-in JIT function and compiled kernel -------------------


@dataclass(frozen=True)
class _Param:
    is_constexpr: bool = False
    do_not_specialize: bool = False
    do_not_specialize_on_alignment: bool = False


class _Kernel(CompiledKernel):
    def __init__(self, calls: list) -> None:  # NOTE: no compilation behind it
        self.calls, self.function, self.packed_metadata, self.name = calls, "fn", "meta", "fake"
        self.module = None

    def _init_handles(self) -> None:
        pass

    def run(self, *args: object) -> None:  # noqa: D102 - Triton's launcher
        self.calls.append(("lean", args))


class _Jit:
    """``A`` aligned-specialized, ``B`` not; ``n`` value-specialized, ``m`` not; ``BLOCK``."""

    arg_names = ["A", "B", "n", "m", "BLOCK"]
    params = [
        _Param(),
        _Param(do_not_specialize_on_alignment=True),
        _Param(),
        _Param(do_not_specialize=True),
        _Param(is_constexpr=True),
    ]

    def __init__(self) -> None:
        self.calls: list = []

    def __getitem__(self, grid: tuple) -> object:
        def launch(*args: object, **constants: object) -> _Kernel:
            self.calls.append(("triton", args, constants))
            return _Kernel(self.calls)

        return launch


@pytest.fixture
def jit(monkeypatch) -> _Jit:
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    device = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 7)
    monkeypatch.setattr(launches, "driver", SimpleNamespace(active=device))
    return _Jit()


def _buffer(dtype: torch.dtype = torch.int8, offset: int = 0) -> torch.Tensor:
    return torch.zeros(64, dtype=dtype)[offset:]


def _paths(fn: _Jit) -> list[str]:
    return [call[0] for call in fn.calls]


def test_only_a_launch_of_the_cached_specialization_runs_its_binary(jit):
    kernels = CompiledLaunches(jit)
    a, b = _buffer(), _buffer()
    launch = kernels((1, 1, 1), (a, b), (32, 5), {"BLOCK": 16})
    assert launch is not None and _paths(jit) == ["triton"]
    a2, b2 = _buffer(), _buffer()
    kernels((2, 1, 1), (a2, b2), (48, 7), {"BLOCK": 16})  # the same key
    assert jit.calls[-1] == (
        "lean",
        (2, 1, 1, 7, "fn", "meta", None, None, None, a2.data_ptr(), b2.data_ptr(), 48, 7, 16),
    )
    changed = [
        ((a, b), (33, 5), {"BLOCK": 16}),  # 16 no longer divides n
        ((a, b), (1, 5), {"BLOCK": 16}),  # n is 1
        ((a, b), (32, 2**31), {"BLOCK": 16}),  # m is an i64
        ((a, b), (32, 5), {"BLOCK": 32}),  # another constexpr
        ((_buffer(torch.float32), b), (32, 5), {"BLOCK": 16}),
    ]  # another dtype
    for tensors, scalars, constants in changed:
        jit.calls.clear()
        kernels((1, 1, 1), tensors, scalars, constants)
        assert _paths(jit) == ["triton"], (scalars, constants)
        kernels((1, 1, 1), tensors, scalars, constants)
        assert _paths(jit) == ["triton", "lean"], "then cached under its own key"
    jit.calls.clear()
    kernels((1, 1, 1), (a, _buffer(offset=3)), (32, 5), {"BLOCK": 16})  # B: any alignment
    assert _paths(jit) == ["lean"]
    assert kernels((1, 1, 1), (_buffer(offset=3), b), (32, 5), {"BLOCK": 16}) is None
    assert _paths(jit) == ["lean", "triton"], "a misaligned A takes Triton's path"


def test_another_triton_version_launches_through_triton_with_one_warning(jit, monkeypatch, caplog):
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    launches._warn_unsupported.cache_clear()
    kernels = CompiledLaunches(jit)
    for _ in range(3):
        assert kernels((1, 1, 1), (_buffer(), _buffer()), (32, 5), {"BLOCK": 16}) is None
    assert _paths(jit) == ["triton"] * 3
    warnings = [r for r in caplog.records if "3.9.0" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    launches._warn_unsupported.cache_clear()


# --- the key refines Triton's own, over what serving launches (interpreter) ----------------


def _flags(fn: object) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """A launcher's alignment-checked positions and value flags from an interpreted kernel's
    decorator arguments (compiled kernels carry them as ``params``)."""
    opts = getattr(fn, "kwargs", {})
    dns, dnsa = (
        set(opts.get("do_not_specialize") or ()),
        set(opts.get("do_not_specialize_on_alignment") or ()),
    )
    names = [
        n
        for n, p in inspect.signature(fn.fn).parameters.items()
        if "constexpr" not in str(p.annotation)
    ]
    return (
        tuple(i for i, n in enumerate(names) if n not in dnsa),
        tuple(n not in dns for n in names),
    )


def _all_launchers() -> dict[str, CompiledLaunches]:
    from pcgspec import kernels

    names = (
        "build_sampling_params",
        "extend_attention",
        "ngram_propose",
        "pad_batch",
        "padded_rows",
        "sample_tokens",
        "verify_draft_tokens",
    )
    modules = [importlib.import_module(f"{kernels.__name__}.{name}") for name in names]
    return {
        value.fn.__name__: value
        for m in modules
        for value in vars(m).values()
        if isinstance(value, CompiledLaunches)
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="launches on CPU tensors: interpreter only")
def test_one_launch_key_is_one_triton_specialization(monkeypatch):
    from test_kernel_warmup import TINY, _key, _serve_like

    from pcgspec.kernels.verify_draft_tokens import VerifyStrategy, verify_draft_tokens

    current: list[tuple] = []
    seen: dict[str, dict[tuple, set]] = collections.defaultdict(
        lambda: collections.defaultdict(set)
    )
    for launcher in _all_launchers().values():
        align, values = _flags(launcher.fn)
        monkeypatch.setattr(launcher, "_align_checked", align)
        monkeypatch.setattr(launcher, "_value_specialized", values)
    call = CompiledLaunches.__call__

    def keyed_call(self, grid, tensors, scalars, constants):  # noqa: ANN001, ANN202
        aligned = self.aligned([t.data_ptr() for t in tensors])
        current.append(self.launch_key(tensors, scalars, constants) if aligned else None)
        try:
            return call(self, grid, tensors, scalars, constants)
        finally:
            current.pop()

    kernel_type = type(next(iter(_all_launchers().values())).fn)
    run = kernel_type.run

    def recording_run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        if current and current[-1] is not None:
            seen[self.fn.__name__][current[-1]].add(_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(CompiledLaunches, "__call__", keyed_call)
    monkeypatch.setattr(kernel_type, "run", recording_run)
    _serve_like(TINY)
    for k, v in ((1, 32), (2, 33), (16, 48), (17, 47)):  # value-specialized ints: 1, 16 | n
        verify_draft_tokens(
            torch.rand(2, k + 1, v), torch.randint(0, v, (2, k)), VerifyStrategy.GREEDY
        )
    assert set(seen) == set(_all_launchers())
    for name, by_key in seen.items():
        for triton_keys in by_key.values():
            assert len(triton_keys) == 1, f"{name}: one launch key, {len(triton_keys)} binaries"


# --- on the GPU: lean launches equal Triton's own, bit for bit ------------------------------


def _pad_batch_case() -> list[torch.Tensor]:
    from test_pad_batch import DEVICE

    from pcgspec.kernels.pad_batch import pad_batch

    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 5, 1, 7], dtype=torch.int32)
    n, rows = int(lens.sum()), 21
    ids, pos, loc = (torch.randint(0, 1000, (n,), generator=gen).to(DEVICE) for _ in range(3))
    out = [torch.full((rows,), -7, dtype=torch.int64, device=DEVICE) for _ in range(3)]
    start = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    pad_batch(ids, pos, loc, lens.to(DEVICE), *out, start)
    return [*out, start]


def _padded_requests_case() -> list[torch.Tensor]:
    """``pad_batch`` as an extend graph calls it: the requests padded, with the page table and
    the sampled rows."""
    from test_pad_batch import DEVICE

    from pcgspec.kernels.pad_batch import PaddedRequests, pad_batch

    gen = torch.Generator().manual_seed(1)
    lens = torch.tensor([3, 5, 1, 7], dtype=torch.int32)
    n, rows, reqs = int(lens.sum()), 21, 6
    ids, pos, loc = (torch.randint(0, 1000, (n,), generator=gen).to(DEVICE) for _ in range(3))
    out = [torch.full((rows,), -7, dtype=torch.int64, device=DEVICE) for _ in range(3)]
    start, seq, ext = (torch.zeros(reqs, dtype=torch.int32, device=DEVICE) for _ in range(3))
    table = torch.randint(0, 1 << 20, (4, 5), generator=gen, dtype=torch.int32).to(DEVICE)
    out_table = torch.full((reqs, 8), -3, dtype=torch.int32, device=DEVICE)
    sampled = torch.tensor([2, 7, 8, 15], device=DEVICE)
    out_sampled = torch.full((reqs,), -4, dtype=torch.int64, device=DEVICE)
    requests = PaddedRequests(
        (lens + 9).to(DEVICE), seq, ext, table, out_table, sampled, out_sampled
    )
    pad_batch(ids, pos, loc, lens.to(DEVICE), *out, start, requests)
    return [*out, start, seq, ext, out_table, out_sampled]


def _padded_rows_case() -> list[torch.Tensor]:
    from test_padded_rows import DEVICE, _case, _tokens

    from pcgspec.kernels.padded_rows import GraphRows, padded_rows, padded_rows_into

    b, k1, page = 5, 4, 4
    starts, table = _case(b, k1, page, seed=1)
    tokens = _tokens(b, k1, seed=2)
    valid = torch.randint(0, k1 + 1, (b,), generator=torch.Generator().manual_seed(3))
    out = padded_rows(starts, table, page, k1, valid.to(DEVICE), start_offset=1, tokens=tokens)
    bucket = b + 3
    rows = GraphRows(
        *(torch.full((bucket * k1,), -7, device=DEVICE) for _ in range(3)),
        torch.zeros(bucket, dtype=torch.int32, device=DEVICE),
        torch.full((bucket,), k1, dtype=torch.int32, device=DEVICE),
        torch.arange(bucket * k1, device=DEVICE),
    )
    padded_rows_into(rows, starts, table, page, k1, start_offset=-1, tokens=tokens)
    return [t for t in vars(out).values() if t is not None] + list(vars(rows).values())


def _sampling_case() -> list[torch.Tensor]:
    from test_spec_kernels import DEVICE, I64, _filled, _int64, _request_table

    from pcgspec.kernels.build_sampling_params import advance_positions, build_sampling_params

    gen = torch.Generator().manual_seed(4)
    table = _request_table(12, gen)
    rows = torch.tensor([4, 1, 4, 4, 1], **I64)
    slots = torch.tensor([3, 0, 11, -1, 6], **I64)
    built = build_sampling_params(table, rows, 16, req_slots=slots, out=_filled(16))
    emitted = torch.tensor([2, 1, 0, 4, 3], **I64)
    tokens = _int64(20, gen, 0, 500).view(5, 4)
    last, prompt = _int64(12, gen, 0, 500), _int64(12, gen, 0, 6)
    history = torch.randint(0, 500, (12, 17), generator=gen, dtype=torch.int32).to(DEVICE)
    advance_positions(
        table.position,
        emitted,
        slots,
        tokens=tokens,
        last_token=last,
        history=history,
        prompt_len=prompt,
    )
    return [*built.tensors(), table.position, last, history]


def _token_draw_case() -> list[torch.Tensor]:
    from test_spec_kernels import DEVICE, _int64, _probs

    from pcgspec.kernels.sample_tokens import sample_tokens
    from pcgspec.sampling import GREEDY_EPS
    from pcgspec.sampling.rng import STREAM_TOKEN

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 300, generator=gen).to(DEVICE)
    probs = _probs((6, 300), gen).to(DEVICE)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 0.3, 2.0], device=DEVICE)
    seed, position = _int64(6, gen), _int64(6, gen, 0, 5000)
    args = (STREAM_TOKEN, GREEDY_EPS)
    return [sample_tokens(probs, logits, temperature, seed, position, *args, block_v=128)]


def _verify_case() -> list[torch.Tensor]:
    from test_spec_kernels import _verify_inputs

    from pcgspec.kernels.verify_draft_tokens import VerifyStrategy, verify_draft_tokens

    outs = []
    for i, strategy in enumerate((VerifyStrategy.REJECTION, VerifyStrategy.TARGET_MATCH)):
        gen = torch.Generator().manual_seed(5 + i)
        p, drafts, kwargs = _verify_inputs(3, 4, 300, strategy, True, gen)
        out = verify_draft_tokens(p, drafts, strategy, block_v=128, **kwargs)
        outs += [out.accept_len, out.tokens]
    return outs


def _ngram_case() -> list[torch.Tensor]:
    from test_ngram import DEVICE

    from pcgspec.kernels.ngram_propose import ngram_propose

    gen = torch.Generator().manual_seed(6)
    history = torch.randint(0, 5, (6, 64), generator=gen).to(DEVICE)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    lengths = torch.tensor([64, 17, 40], device=DEVICE)
    return list(ngram_propose(history, slots, lengths, 3, 1, 4))


def _extend_case() -> list[torch.Tensor]:
    from test_triton_attention import DEVICE, SPLIT_CASES, _extend_problem

    from pcgspec.kernels.attention import decode_workspace
    from pcgspec.kernels.extend_attention import extend_attention, plan_extend

    case, splits = SPLIT_CASES["mixed_prefixes_padded"]
    page_size, h, kv, d, reqs, _, block = case
    (q, k, v), caches, index = _extend_problem(
        case, torch.float32, torch.float32, torch.Generator().manual_seed(7)
    )
    ext = [new for _, new in reqs]
    plan = plan_extend(
        ext,
        len(q),
        h,
        kv,
        d,
        torch.float32,
        page_size,
        d**-0.5,
        num_splits=splits,
        block_m=block,
        block_n=block,
    )
    workspace = decode_workspace(len(q), h, d, splits, DEVICE)
    outs = []
    for layer_caches in (caches, tuple(c.clone() for c in caches)):  # two layers, one plan
        out = torch.zeros_like(q)
        extend_attention(q, k, v, out, *layer_caches, *index, plan, workspace=workspace)
        outs += [out, *layer_caches]
    return outs


GPU_CASES = {  # case -> (run it on fixed random inputs: what it wrote, the kernels it launches)
    "pad_batch": (_pad_batch_case, {"_pad_batch_kernel"}),
    "pad_batch_requests": (_padded_requests_case, {"_pad_batch_kernel"}),
    "padded_rows": (_padded_rows_case, {"_padded_rows_kernel"}),
    "sampling": (_sampling_case, {"_build_kernel", "_advance_kernel"}),
    "verify": (_verify_case, {"_verify_rows_kernel", "_accept_kernel"}),
    "token_draw": (_token_draw_case, {"_sample_kernel"}),
    "ngram": (_ngram_case, {"_ngram_kernel"}),
    "extend": (_extend_case, {"_extend_kernel", "_merge_kernel"}),
}


def test_every_lean_launched_kernel_has_a_gpu_case():
    assert set().union(*(names for _, names in GPU_CASES.values())) == set(_all_launchers())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_lean_launches_equal_tritons_own_bit_for_bit(case, monkeypatch):
    run, names = GPU_CASES[case]
    make_launcher, lean = launches.compiled_launcher, collections.Counter()

    def counted(kernel: object, trailing: tuple = ()) -> object:
        launch = make_launcher(kernel, trailing)
        if launch is None:
            return None

        def counting(grid: tuple, *args: object) -> None:
            lean[kernel.name] += 1
            launch(grid, *args)

        return counting

    def clear() -> None:
        for launcher in _all_launchers().values():
            launcher.clear()

    assert lean_launches_supported(), f"Triton {triton.__version__}: lean launches are off"
    monkeypatch.setattr(launches, "compiled_launcher", lambda kernel, trailing=(): None)
    clear()
    want = run()  # Triton's own launch every time
    monkeypatch.setattr(launches, "compiled_launcher", counted)
    clear()
    run()  # each specialization's first launch: Triton's, then cached
    lean.clear()
    got = run()
    torch.cuda.synchronize()
    assert set(lean) == names, f"lean launches: {dict(lean)}"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(_bits(g), _bits(w)), i
