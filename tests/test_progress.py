"""Progress bars are drawn only when stderr is a terminal, through one helper."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pcgspec.models.loader import iter_safetensors
from pcgspec.progress import progress

PACKAGE = Path(__file__).resolve().parents[1] / "pcgspec"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "drawn"), [(_Terminal(), True), (io.StringIO(), False)])
def test_a_bar_is_drawn_on_a_terminal_only(monkeypatch, stream, drawn):
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(progress(range(3), desc="work")) == [0, 1, 2]
    assert ("work" in stream.getvalue()) is drawn
    list(progress(range(3), desc="hidden", show=False))
    assert "hidden" not in stream.getvalue()


def test_loading_weights_into_a_log_draws_no_bar(tmp_path, monkeypatch):
    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, tmp_path / "model.safetensors")
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    assert [name for name, _ in iter_safetensors([tmp_path / "model.safetensors"])] == ["a", "b"]
    assert log.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    list(iter_safetensors([tmp_path / "model.safetensors"]))
    assert "Loading weights" in terminal.getvalue()


def test_every_bar_goes_through_the_helper():
    imports_tqdm = re.compile(r"^\s*(from|import) tqdm", re.M)
    direct = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "progress.py" and imports_tqdm.search(path.read_text())
    ]
    assert direct == []
