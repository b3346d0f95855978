"""``pcgspec.distributed`` sits below ``pcgspec.runners``: runners import distributed (the
driver, the process groups), distributed imports nothing of runners, not even in a function or
for type checking (rank 0's runner hands the launcher the worker entry point,
``runners/tp_worker.py``), so there is no import loop to break by import order.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pcgspec"


def _modules(package: str) -> list[str]:
    path = PACKAGE / package
    return [f"pcgspec.{package}.{m.name}" for m in pkgutil.iter_modules([str(path)])]


def _imported(path: Path) -> set[str]:
    """Every module ``path`` names in an import statement, wherever the statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_distributed_imports_nothing_of_runners():
    offenders = {
        path.name: sorted(n for n in _imported(path) if n.startswith("pcgspec.runners"))
        for path in sorted((PACKAGE / "distributed").glob("*.py"))
    }
    assert not {name: found for name, found in offenders.items() if found}
    assert _imported(PACKAGE / "runners" / "model_runner.py") >= {"pcgspec.distributed.launcher"}


def test_the_scan_sees_imports_in_functions_and_type_checking_blocks(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from pcgspec.runners.forward_batch import ForwardBatch\n"
        "def f():\n    import pcgspec.runners.model_runner\n"
        "    from pcgspec import runners\n"
    )
    assert {
        "pcgspec.runners.forward_batch",
        "pcgspec.runners.model_runner",
        "pcgspec.runners",
    } <= _imported(source)


@pytest.mark.parametrize("first", ["distributed", "runners"])
def test_every_module_imports_in_a_fresh_interpreter_in_either_order(first: str):
    """Importing all of ``first`` then all of the other package succeeds; distributed's
    modules load no runners module on their own.
    """
    second = "runners" if first == "distributed" else "distributed"
    script = "\n".join(
        [
            "import importlib, sys",
            f"for name in {_modules(first)!r}:",
            "    importlib.import_module(name)",
            "loaded = sorted(k for k in sys.modules if k.startswith('pcgspec.runners'))",
            f"assert {first!r} != 'distributed' or not loaded, loaded",
            f"for name in {_modules(second)!r}:",
            "    importlib.import_module(name)",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
