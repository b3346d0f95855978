"""Write docs/benchmarks.md from bench/results/*.json: one section per kind of result.

Each result file becomes one table row: its date, device (and torch), the command that wrote it
and a few of its top-level numbers. The schemas differ between scripts, so the summary is
generic: headline fields known across scripts first (throughputs, TTFT p50, ratios, accept
length), then other top-level numbers, never the arguments. The page is generated, never
edited by hand; ``tests/test_docs.py`` checks that the committed page is what this writes.

    python scripts/gen_bench_docs.py            # rewrite docs/benchmarks.md
    python scripts/gen_bench_docs.py --check    # exit 1 if the page is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"

KINDS = {  # file-name prefix -> section title, in page order
    "ttft": "Prefill time to first token (`scripts/bench_ttft.py`)",
    "coldstart": "Cold start (`scripts/bench_ttft.py --cold-start`)",
    "decode": "Decode step (`scripts/bench_decode.py`)",
    "copy": "Device copy bandwidth",
    "engine": "Engine step against graph replay (`scripts/bench_engine.py`)",
    "profile": "Step profiles (`scripts/profile_step.py`, `scripts/profile_spec_step.py`)",
    "spec": "Speculative decoding (`scripts/bench_spec.py`)",
    "serving": "Serving (`scripts/bench_serving.py`)",
    "prefix": "Prefix caching (`scripts/bench_serving.py --dataset shared-prefix|multi-turn`)",
    "extend": "Extend attention over a cached prefix (`scripts/bench_extend_prefix.py`)",
    "generate": "Offline generation (`LLM.generate`, `pcgspec train-eagle3 --phases generate`)",
    "gc": "Garbage collection",
    "tp": "Tensor parallelism (`scripts/bench_tp.py`)",
    "train": "EAGLE3 head training (`pcgspec train-eagle3`)",
    "eagle3": "EAGLE3 accept-length estimates",
    "gpu_tests": "GPU test runs (`pytest -m gpu`)",
    "greedy_equal": "Greedy output against transformers (`scripts/check_greedy_equal.py`)",
    "accept": "Accept length of a draft model, greedy, on the CPU (`scripts/measure_accept.py`)",
}
HEADLINE = [  # key paths (dotted) matched in this order
    r"\w+_comparison\.[^.]+\.ratio",
    r"request_throughput",
    r"output_token_throughput",
    r"ttft\.p50_ms",
    r"tpot\.p50_ms",
    r"avg_spec_accept_length",
    r"datasets\.[^.]+\.accept_length",
    r"lossless\.(requests|equal)",
    r"ratios\.[^.]+",
    r".*speedup.*",
    r".*GBps.*",
    r"cold_start\.[^.]+",
    r"times_s\.[^.]+",
    r".*step_ms.*",
]
LISTS = ("rows", "steps", "runs")
SKIP_TREES = {"args", "settings", "targets", "load_average_before_after", *LISTS}
SKIP_KEYS = {"seed", "warmup", "repeats", "port", "page_size", "weight_bytes", "context", "steps"}
ROW_RATIOS = r"speedup|accept_length|_vs_|ratio"
TEST_WORDS = ("passed", "failed", "skipped")
MAX_NUMBERS = 6
MAX_COMMAND = 160


def kind_of(name: str) -> str:
    return max((k for k in KINDS if name.startswith(k + "_")), key=len, default=name.split("_")[0])


def _leaves(obj: dict[str, Any], prefix: str = "", depth: int = 0) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for key, value in obj.items():
        path = f"{prefix}{key}"
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            out.append((path, value))
        elif isinstance(value, dict) and depth < 2 and key not in SKIP_TREES:
            out += _leaves(value, path + ".", depth + 1)
    return out


def headline(data: dict[str, Any]) -> list[tuple[str, float]]:
    leaves = _leaves(data)
    picked = [kv for rx in HEADLINE for kv in leaves if re.fullmatch(rx, kv[0])]
    picked = list(dict.fromkeys(picked))
    rest = [
        kv
        for kv in leaves
        if kv not in picked
        and kv[1] != 0
        and kv[0].count(".") < 2
        and kv[0].split(".")[-1] not in SKIP_KEYS
    ]
    return (picked + rest)[:MAX_NUMBERS]


def _label(path: str) -> str:
    """``cache_comparison.ttft_p50_ms.ratio`` -> ``ttft_p50_ms ratio``; others unchanged."""
    m = re.fullmatch(r"\w+_comparison\.([^.]+)\.ratio", path)
    return f"{m.group(1)} ratio" if m else path


def _fmt(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.4g}"


def _first(data: dict[str, Any], key: str) -> str:
    if data.get(key):
        return str(data[key])
    runs = data.get("runs")
    found = [str(r[key]) for r in runs if r.get(key)] if isinstance(runs, list) else []
    return " / ".join(dict.fromkeys(found))


def _command(data: dict[str, Any]) -> str:
    text = _first(data, "command") or str(data.get("what") or data.get("note") or "")
    text = re.sub(r"\s--(out|base-url|server-log)\s+\S+", "", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= MAX_COMMAND else text[: MAX_COMMAND - 3].rstrip() + "..."


def _list_summary(key: str, items: list[Any]) -> str:
    """``rows: 48 (speedup 0.94-2.41)``: the ranges of the ratio-like columns of a list."""
    dicts = [r for r in items if isinstance(r, dict)]
    columns = dict.fromkeys(k for r in dicts for k in r if re.search(ROW_RATIOS, k))
    ranges = []
    for col in columns:
        vals = [
            r[col]
            for r in dicts
            if isinstance(r.get(col), (int, float)) and not isinstance(r.get(col), bool)
        ]
        if vals:
            ranges.append(f"{col} {_fmt(min(vals))}-{_fmt(max(vals))}")
    return f"{key}: {len(items)}" + (f" ({', '.join(ranges)})" if ranges else "")


def _test_counts(data: dict[str, Any]) -> list[str]:
    text = json.dumps(data)
    counts = {w: sum(int(n) for n in re.findall(rf"(\d+) {w}\b", text)) for w in TEST_WORDS}
    return [f"{n} {w}" for w, n in counts.items() if n] if counts["passed"] else []


def _date(path: Path) -> str:
    data = json.loads(path.read_text())
    return _first(data, "date")[:10] if isinstance(data, dict) else ""


def row(path: Path) -> str:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        data = {"rows": data}
    device = _first(data, "device").replace("NVIDIA ", "") or "-"
    torch = _first(data, "torch")
    where = f"{device}, torch {torch}" if torch else device
    numbers = [f"{_label(k)} {_fmt(v)}" for k, v in headline(data)]
    numbers += [_list_summary(k, data[k]) for k in LISTS if isinstance(data.get(k), list)]
    numbers += _test_counts(data)
    link = f"[`{path.name}`](../bench/results/{path.name})"
    if path.with_suffix(".png").exists():
        link += f" ([plot](../bench/results/{path.stem}.png))"
    command = _command(data)
    cells = [
        link,
        _first(data, "date")[:10] or "-",
        where,
        f"`{command}`" if command else "-",
        "; ".join(numbers) or "-",
    ]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def render(results: Path = RESULTS) -> str:
    files = sorted(results.glob("*.json"))
    groups: dict[str, list[Path]] = {}
    for path in files:
        groups.setdefault(kind_of(path.stem), []).append(path)
    order = [k for k in KINDS if k in groups] + sorted(k for k in groups if k not in KINDS)
    lines = [
        "# Benchmark results",
        "",
        "<!-- Generated by scripts/gen_bench_docs.py from bench/results/*.json; do not edit. -->",
        "",
        f"Every result file in `bench/results/` ({len(files)} JSON files), grouped by kind. A "
        "file is named `<kind>_<what>_<model>_<device>_<date>[_<variant>].json`; `-shape` in "
        "the model means random weights of that model's shape. Each row gives the file's date, "
        "device, torch version, the command that wrote it (output paths left out) and a few of "
        "its top-level numbers; the JSON holds the full rows. The README and the other pages "
        "say which numbers are the current ones.",
        "",
    ]
    for kind in order:
        rows = sorted(groups[kind], key=lambda p: (_date(p), p.name))
        lines += [
            f"## {KINDS.get(kind, kind)}",
            "",
            "| file | date | device | command | numbers |",
            "|---|---|---|---|---|",
        ]
        lines += [row(p) for p in rows] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text() != text
        print("docs/benchmarks.md is stale: run scripts/gen_bench_docs.py" if stale else "ok")
        return int(stale)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
