"""The documentation stays true: the generated benchmark page matches the results, every link
to a result file or a page resolves, the README stays short, and the product's text speaks of
the product only (nothing of how the work behind it was organised)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 420
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".json", ".txt", ".cfg", ".yaml", ".yml"}
# Built from pieces so that this file does not match its own patterns.
FORBIDDEN = {
    "a development-round number": re.compile(r"\b[Ss]essions?" + r"[ -]?\d+"),
    "a tracker number": re.compile(r"\b[Ii]ssues?" + r" ?#?\d+"),
    "accelerator-budget accounting": re.compile(
        r"\bdevice" + r"[- ](sess" + r"ion|call)s?\b|\bdevice" + r"[- ]time (budget|left|used|went)"
        r"|\bno device" + r" time\b",
        re.IGNORECASE,
    ),
}


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_bench_docs", ROOT / "scripts" / "gen_bench_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_bench_docs"] = module
    spec.loader.exec_module(module)
    return module


def _product_text_files() -> list[Path]:
    files = [README, *DOCS]
    for folder in ("pcgspec", "scripts", "tests", "docs"):
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
        ]
    return sorted(set(files))


def test_benchmarks_page_is_what_the_generator_writes():
    page = ROOT / "docs" / "benchmarks.md"
    assert page.read_text() == _load_generator().render(), (
        "docs/benchmarks.md is stale: run python scripts/gen_bench_docs.py"
    )


def test_generator_summarizes_any_schema(tmp_path):
    gen = _load_generator()
    (tmp_path / "spec_all_tiny_h100_2026-01-02.json").write_text(
        json.dumps(
            {
                "date": "2026-01-02T03:04:05+00:00",
                "device": "NVIDIA H100 80GB HBM3",
                "torch": "2.11",
                "command": "bench_spec.py --prompts a|b --out /tmp/x.json",
                "rows": [{"speedup": 0.5}, {"speedup": 2.25}, {"speedup": None}],
            }
        )
    )
    (tmp_path / "gpu_tests_h200_2026-01-01.json").write_text(
        json.dumps(
            {
                "date": "2026-01-01",
                "runs": [
                    {"device": "NVIDIA H200", "result": "7 passed"},
                    {"device": "NVIDIA H200", "result": "2 passed, 1 failed"},
                ],
            }
        )
    )
    (tmp_path / "odd_thing_cpu_2026-01-03.json").write_text(json.dumps([1, 2]))
    page = gen.render(tmp_path)
    assert page.index("## Speculative decoding") < page.index("## GPU test runs")
    assert page.index("## GPU test runs") < page.index("## odd")
    spec_row = next(line for line in page.splitlines() if "spec_all_tiny" in line)
    assert "| 2026-01-02 | H100 80GB HBM3, torch 2.11 |" in spec_row
    assert "a\\|b" in spec_row and "/tmp/x.json" not in spec_row
    assert "rows: 3 (speedup 0.5-2.25)" in spec_row
    tests_row = next(line for line in page.splitlines() if "gpu_tests_h200" in line)
    assert "| H200 |" in tests_row and "9 passed; 1 failed" in tests_row
    assert "rows: 2" in next(line for line in page.splitlines() if "odd_thing" in line)


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_links_resolve(page):
    text = page.read_text()
    missing = [
        name
        for name in re.findall(r"bench/results/([\w.+-]+\.(?:json|png))", text)
        if not (ROOT / "bench" / "results" / name).is_file()
    ]
    assert not missing, f"{page.name} names result files that do not exist: {missing}"
    local = [link for link in _links(text) if not re.match(r"[a-z]+://", link)]
    broken = [
        link
        for link in local
        if not (page.parent / link.split("#")[0]).exists() and not link.startswith("#")
    ]
    assert not broken, f"{page.name} links to missing files: {broken}"


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_product_text_speaks_of_the_product():
    found = []
    for path in _product_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [
                f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()[:100]}"
                for what, rx in FORBIDDEN.items()
                if rx.search(line)
            ]
    assert not found, "\n".join(found)


def test_forbidden_patterns_catch_what_they_should():
    samples = {
        # NOTE: built from pieces, or this file would match itself
        "a development-round number": "measured in sess" + "ion 12",
        "a tracker number": "Iss" + "ue #14",
        "accelerator-budget accounting": "no dev" + "ice time left to run it",
    }
    for what, text in samples.items():
        assert FORBIDDEN[what].search(text), what
    assert not any(
        rx.search("the dev" + "ice time per launch, from CUDA events") for rx in FORBIDDEN.values()
    )
