"""Where a speculative decode step's time goes, side by side with plain decoding in one run.

Per engine and batch size: the decode step's wall time (median over the decode steps of
--repeats generations, overlap schedule as configured), and over one more generation under
torch.profiler, per engine step: the GPU's busy time (the union of kernel intervals; the
generation's prefill is in it), the activities the GPU ran (kernels, copies, memsets) and the
dearest of them by name, and the kernel launches (ATen's and Triton's), copies and graph
launches the host made. A step whose wall time is well above its busy time is host-bound. With
--host-stages, the host's time per engine step in each stage of a step (wall time of wrapped
functions over the timed generations; a ``wait`` stage is the host waiting for the GPU: the step
is GPU-bound by about that much), overall and by kind of step (prefill, mixed, decode,
speculative, first_tokens).
With --cprofile DIR, cProfile of one generation per engine and batch size. With --tp-sizes
1,2 every engine runs at each tensor-parallel size (the profile is rank 0's) and rows at TP > 1
give their step time over the same engine's and batch's at TP=1 (``step_vs_tp1``). --out is written
after each engine (``complete`` false until the last), so a run stopped early keeps its rows.

With ``--in-flight`` a batch size B is a load instead, as in ``bench_spec.py``: --load-requests
prompts given at once to an engine that runs at most B (a request starts as another finishes,
as under a server with B clients), so the steps with prefill work of a served load are in it;
``--prompts served-chat`` takes the served benchmark's chat requests.

Random weights of a named shape (default smollm2-135m, with the default model's tokenizer) or
--model. Every speculative engine runs --speculative-policy always (--policy auto: the policy's
choices, e.g. to profile the plain steps of an engine with a drafter); EAGLE3 runs an untrained
head (draft vocabulary --eagle3-draft-vocab; ``--eagle3-draft shipped`` with ``--model`` the
default model: its shipped head) and STANDALONE drafts with the target itself. Prompts: the
"repeat" or "general" set, or ``chat`` / ``served-chat`` through the model's chat template.
A method ``EAGLE3:D/K/N`` is EAGLE3 with a draft tree of depth D, topk K and N nodes (plain
``EAGLE3`` drafts a chain of --num-steps), so chains and trees profile side by side; each row
also counts the GPU activities per step by name (``gpu_top_count_per_step``): where a step's
time goes into many small kernels rather than a few dear ones.

    python scripts/profile_spec_step.py --methods EAGLE3,NGRAM --batch-sizes 1,16 \\
        --out bench/results/profile_spec_step_smollm2-shape_h100_$(date +%F).json
    python scripts/profile_spec_step.py --shape tiny --methods NGRAM --batch-sizes 1 \\
        --max-tokens 8 --repeats 1                                     # CPU smoke
    NCCL_NVLS_ENABLE=0 python scripts/profile_spec_step.py --shape qwen3-8b --methods EAGLE3 \\
        --batch-sizes 1 --num-steps 3 --tp-sizes 1,2 --repeats 5 --no-plain  # the TP step
    python scripts/profile_spec_step.py --model "$(python -c 'from pcgspec.models.default_model \\
        import default_model_path as d; print(d())')" --eagle3-draft shipped --methods EAGLE3 \\
        --num-steps 3 --policy auto --prompts served-chat --in-flight --load-requests 128 \\
        --batch-sizes 16,64 --max-tokens 128 --host-stages
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import (  # noqa: E402
    StepTimes,
    _sync,
    add_in_flight_args,
    check_trees,
    cycled,
    prompt_pool,
    running_at_most,
    tree_kwargs,
)

from pcgspec import LLM, SamplingParams  # noqa: E402
from pcgspec.engine import engine, overlap, scheduler  # noqa: E402
from pcgspec.runners import model_runner, spec_step_graphs  # noqa: E402
from pcgspec.sampling import slots  # noqa: E402
from pcgspec.speculative import model_proposer, ngram, worker  # noqa: E402

# the host's CUDA calls by kind, by name prefix: kernel launches through the runtime (ATen) and
# through the driver (Triton, inductor), copies, graph launches
HOST_CALLS = {
    ("cudaLaunchKernel", "cuLaunchKernel"): "kernel_launches",
    ("cudaMemcpy",): "copies",
    ("cudaGraphLaunch",): "graph_launches",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="random weights of this shape")
    p.add_argument("--model", default=None, help="an HF folder instead of random weights")
    p.add_argument(
        "--tokenizer", default=None, help="with random weights (default: the default model's)"
    )
    p.add_argument("--methods", default="EAGLE3,NGRAM,STANDALONE")
    p.add_argument("--num-steps", type=int, default=4, help="--speculative-num-steps (k)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--tp-sizes", default="1", help="tensor-parallel sizes, each engine at each")
    p.add_argument(
        "--plain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plain decoding beside the methods at each TP size (step_vs_plain_step); "
        "--no-plain: the methods only (an engine fewer per TP size)",
    )
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eagle3-draft-vocab", type=int, default=16384)
    p.add_argument(
        "--eagle3-draft",
        default="untrained",
        help="untrained, shipped (the default model's head) or a head's folder",
    )
    p.add_argument(
        "--prompts", choices=("repeat", "general", "chat", "served-chat"), default="repeat"
    )
    add_in_flight_args(p)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument(
        "--policy",
        choices=("always", "auto"),
        default="always",
        help="--speculative-policy of the speculative engines",
    )
    p.add_argument("--host-stages", action="store_true", help="host time per step stage")
    p.add_argument("--cprofile", type=Path, default=None, help="folder for cProfile reports")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_trees(p, (m.partition(":")[2] for m in args.methods.split(",") if ":" in m))
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    if min(args.tp_sizes) < 1 or len(set(args.tp_sizes)) != len(args.tp_sizes):
        p.error(f"--tp-sizes: distinct sizes >= 1, got {args.tp_sizes}")
    return args


def _model(args: argparse.Namespace) -> tuple[str, dict]:
    """The target folder and the engine keywords every engine shares."""
    from pcgspec.models.default_model import default_model_path
    from pcgspec.models.draft_checkpoint import write_random_checkpoint

    base = {
        "log_level": "warning",
        "max_total_tokens": 1 << 16,
        "disable_overlap_schedule": args.disable_overlap_schedule,
    }
    if args.model is not None:
        return args.model, base
    tokenizer = args.tokenizer or str(default_model_path())
    folder = tempfile.mkdtemp(prefix=f"pcgspec-{args.shape}-")
    return str(write_random_checkpoint(args.shape, folder, tokenizer)), {
        **base,
        "tokenizer": tokenizer,
    }


def _engine_kwargs(method: str, model: str, args: argparse.Namespace) -> dict:
    if method == "none":
        return {}
    from pcgspec.models.eagle3 import write_eagle3_checkpoint
    from pcgspec.models.loader import load_config

    method, _, tree = method.partition(":")
    kw = {
        "speculative_algorithm": method,
        "speculative_num_steps": args.num_steps,
        "speculative_policy": args.policy,
        **(tree_kwargs(tree) if tree else {}),
    }
    if method == "EAGLE3" and args.eagle3_draft == "shipped":
        kw["speculative_draft_model_path"] = None  # the default model's own head
    elif method == "EAGLE3" and args.eagle3_draft != "untrained":
        kw["speculative_draft_model_path"] = args.eagle3_draft
    elif method == "EAGLE3":
        head = write_eagle3_checkpoint(
            Path(tempfile.mkdtemp()) / "eagle3",
            load_config(model),
            seed=0,
            draft_vocab_size=args.eagle3_draft_vocab,
        )
        kw["speculative_draft_model_path"] = str(head)
    elif method == "STANDALONE":
        kw["speculative_draft_model_path"] = model
    elif method != "NGRAM":
        raise ValueError(f"--methods: {method!r} is not one of EAGLE3, NGRAM, STANDALONE")
    return kw


# the stages of a decode step whose host time --host-stages reports: (owner, attribute names)
STAGES = (
    (engine.Engine, ("step", "_read", "_forward_and_sample", "_build_forward_batch")),
    (scheduler.Scheduler, ("schedule", "retire")),
    (overlap.LaunchedStep, ("wait",)),
    (
        worker.SpecWorker,
        ("chooses", "observe", "launch", "_page_table", "propose", "verify", "read"),
    ),
    (worker.LaunchedSpecStep, ("wait",)),
    (worker, ("device_page_table", "build_verify_batch", "verify_draft_tokens")),
    (slots.SamplingSlots, ("seq_lens", "rows", "commit")),
    (model_runner.ModelRunner, ("forward", "sample")),
    (spec_step_graphs.SpecStepGraphs, ("replay",)),
    (model_proposer.ModelProposer, ("propose", "verified", "prepare_replay", "replayed", "read")),
    (ngram.NgramProposer, ("propose",)),
)


@contextlib.contextmanager
def host_stages():
    """While the block runs, every function of ``STAGES`` adds its wall time and calls to the
    yielded ``{kind: {"Owner.name": [ns, calls]}}``, under the kind of the engine step it ran
    in (``Engine.step_counts``: the kind whose count the step raised; ``read_only``: none, a
    step that launched nothing and read the steps in flight)."""
    by_kind: dict[str, dict[str, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0, 0])
    )
    current: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # this step's
    originals = []
    for owner, names in STAGES:
        for name in names:
            fn = owner.__dict__[name]
            label = f"{getattr(owner, '__name__', '').rsplit('.', 1)[-1]}.{name}"

            def timed(*args, _fn=fn, _label=label, **kwargs):  # noqa: ANN002, ANN003, ANN202
                start = time.perf_counter_ns()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    total = current[_label]
                    total[0] += time.perf_counter_ns() - start
                    total[1] += 1

            originals.append((owner, name, fn))
            setattr(owner, name, functools.wraps(fn)(timed))
    timed_step = engine.Engine.step

    def step(self):  # noqa: ANN001, ANN202
        before = dict(self.step_counts)
        try:
            return timed_step(self)
        finally:
            kind = next((k for k, n in self.step_counts.items() if n != before[k]), "read_only")
            _add_stages(by_kind[kind], current)
            current.clear()

    engine.Engine.step = functools.wraps(timed_step)(step)
    try:
        yield by_kind
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def _add_stages(into: dict[str, list[int]], totals: dict[str, list[int]]) -> None:
    """Add ``totals``' ``[ns, calls]`` per stage to ``into``'s (a defaultdict of them)."""
    for label, (ns, calls) in totals.items():
        into[label][0] += ns
        into[label][1] += calls


def _stage_row(totals: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Per engine step: each stage's host microseconds and calls, dearest first."""
    steps = max(totals["Engine.step"][1], 1)
    ranked = sorted(((k, v) for k, v in totals.items() if v[1]), key=lambda kv: -kv[1][0])
    return {
        k: {"us": round(ns / 1e3 / steps, 1), "calls": round(n / steps, 2)} for k, (ns, n) in ranked
    }


def host_stages_by_kind(
    by_kind: dict[str, dict[str, list[int]]],
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, dict[str, float]]]]:
    """The stage rows (``_stage_row``) of every step and of each kind of step apart, with the
    kind's step count under ``steps``."""
    every: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for totals in by_kind.values():
        _add_stages(every, totals)
    kinds = {
        kind: {"steps": totals["Engine.step"][1], "stages": _stage_row(totals)}
        for kind, totals in sorted(by_kind.items())
    }
    return _stage_row(every), kinds


def _busy_ms(events: list) -> float:
    """The union of the CUDA kernel intervals, in ms."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    total, current = 0.0, None
    for start, end in spans:
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        total += current[1] - current[0]
    return total / 1e3


def _top_activities(events: list, steps: int, top: int = 20) -> dict[str, float]:
    """The GPU activities that took the most time, by name: microseconds per engine step."""
    totals: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:80]] += e.time_range.end - e.time_range.start
    return {name: round(us / steps, 1) for name, us in totals.most_common(top)}


def _top_counts(events: list, steps: int, top: int = 20) -> dict[str, float]:
    """The GPU activities run most often, by name: how many per engine step."""
    counts = collections.Counter(
        e.name[:80] for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return {name: round(n / steps, 2) for name, n in counts.most_common(top)}


def profile_batch(llm: LLM, name: str, batch: int, args: argparse.Namespace, tp: int = 1) -> dict:
    """One row; under ``--in-flight`` the engine runs at most ``batch`` requests throughout."""
    if not args.in_flight:
        return _profile(llm, name, batch, args, batch, tp)
    with running_at_most({name: llm}, batch):
        return _profile(llm, name, batch, args, args.load_requests, tp)


def _profile(
    llm: LLM, name: str, batch: int, args: argparse.Namespace, requests: int, tp: int
) -> dict:
    prompts = cycled(prompt_pool(args.prompts, llm.get_tokenizer()), requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = llm.engine
    for _ in range(2):
        llm.generate(prompts, params, use_tqdm=False)
    with StepTimes(engine) as times:
        for _ in range(args.repeats):
            llm.generate(prompts, params, use_tqdm=False)
    stages = by_kind = None
    if args.host_stages:
        with host_stages() as totals:
            for _ in range(args.repeats):
                llm.generate(prompts, params, use_tqdm=False)
            _sync()
        stages, by_kind = host_stages_by_kind(totals)
    steps, step = [], engine.step

    def counted():
        steps.append(time.perf_counter())
        return step()

    engine.step = counted
    activities = [torch.profiler.ProfilerActivity.CPU]
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            _sync()
    finally:
        del engine.step
    events, n = prof.events(), len(steps)
    host = collections.Counter(
        label
        for e in events
        for prefixes, label in HOST_CALLS.items()
        if e.name.startswith(prefixes)
    )
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
    row = {
        "engine": name,
        "batch": batch,
        "decode_steps": len(times.times["step"]),
        "step_ms_median": times.median_ms("step"),
        "gpu_busy_ms_per_step": _busy_ms(events) / n if on_cuda else None,
        "gpu_activities_per_step": kernels / n if on_cuda else None,  # kernels, copies, sets
        "gpu_top_us_per_step": _top_activities(events, n) if on_cuda else None,
        "gpu_top_count_per_step": _top_counts(events, n) if on_cuda else None,
        **{label: host[label] / n if on_cuda else None for label in HOST_CALLS.values()},
        "spec": engine.spec_stats(),
        "host_stages_us_per_step": stages,
        "host_stages_by_kind": by_kind,
    }
    if args.cprofile is not None:
        args.cprofile.mkdir(parents=True, exist_ok=True)
        profiler = cProfile.Profile()
        profiler.runcall(llm.generate, prompts, params, use_tqdm=False)
        _sync()
        suffix = "" if tp == 1 else f"_tp{tp}"
        profiler.dump_stats(str(args.cprofile / f"{name}_{batch}{suffix}.prof"))
    return row


def _step_over(row: dict, rows: list[dict], key: dict) -> float | None:
    """``row``'s median step time over that of the row (``row`` itself included) matching
    ``key``'s tp, engine and batch; None when no row does."""
    fields = ("tp", "engine", "batch")
    base = next((r for r in [*rows, row] if all(r[f] == key[f] for f in fields)), None)
    return None if base is None else row["step_ms_median"] / base["step_ms_median"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, base = _model(args)
    methods = [*(["none"] if args.plain else []), *[m for m in args.methods.split(",") if m]]
    rows: list[dict] = []
    for tp, method in ((tp, m) for tp in args.tp_sizes for m in methods):
        llm = LLM(model, **base, tp_size=tp, **_engine_kwargs(method, model, args))
        for batch in args.batch_sizes:
            row = {"tp": tp, **profile_batch(llm, method, batch, args, tp)}
            same = {"tp": tp, "engine": "none", "batch": batch}  # plain decoding, this TP size
            row["step_vs_plain_step"] = _step_over(row, rows, same)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "spec"}), flush=True)
        llm.shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _result(args, rows, complete=False)  # NOTE: a run stopped later keeps these rows
    return _result(args, rows, complete=True)


def _result(args: argparse.Namespace, rows: list[dict], complete: bool) -> dict:
    """The rows so far, written to ``--out``; each row at TP > 1 over its TP=1 row, once that
    has run (``--tp-sizes`` may list 1 after the others)."""
    for row in rows if 1 in args.tp_sizes else ():
        if row["tp"] != 1:
            row["step_vs_tp1"] = _step_over(row, rows, {**row, "tp": 1})
    result = {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "model": args.model or f"{args.shape} (random weights)",
        "num_steps": args.num_steps,
        "tp_sizes": args.tp_sizes,
        "policy": args.policy,
        "load": f"{args.load_requests} requests, batch = in flight" if args.in_flight else "batch",
        "complete": complete,
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
