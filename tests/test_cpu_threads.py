"""CPU threads: chosen when an engine on the CPU starts, never at import; the default leaves
out the cores other load is using.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pcgspec.cli import build_parser
from pcgspec.config import EngineConfig
from pcgspec.engine import cpu_threads
from pcgspec.engine.cpu_threads import CPU_THREADS_CAP, CpuInfo, apply_cpu_threads
from pcgspec.engine.cpu_threads import default_cpu_threads as default

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_threads(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "_chosen", None)  # as in a process with no engine yet
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("info", "tp_size", "want"),
    [
        (CpuInfo(allowed=2, physical=2, online=2, load=0.1), 1, 2),  # idle
        (CpuInfo(allowed=2, physical=2, online=2, load=1.0), 1, 1),  # one core busy elsewhere
        (CpuInfo(allowed=2, physical=2, online=2, load=3.7), 1, 1),  # overloaded: still 1
        (CpuInfo(allowed=16, physical=8, online=16, load=0.0), 1, 8),  # SMT siblings left out
        (CpuInfo(allowed=4, physical=4, online=64, load=8.0), 1, 4),  # a share of a big host
        (CpuInfo(allowed=128, physical=64, online=128, load=0.0), 1, CPU_THREADS_CAP),
        (CpuInfo(allowed=8, physical=8, online=8, load=0.0), 2, 4),  # split between ranks
        (CpuInfo(allowed=2, physical=2, online=2, load=0.0), 4, 1),
    ],
)
def test_default_is_the_idle_physical_cores_capped(info, tp_size, want):
    assert default(info, tp_size) == want


def test_probe_reads_this_machine():
    info = CpuInfo.probe()
    assert 1 <= info.physical <= info.allowed <= info.online and info.load >= 0


@pytest.mark.parametrize(
    ("quota", "period", "want"),
    [
        ("200000", "100000", 2),
        ("150000", "100000", 2),
        ("max", "100000", None),
        ("-1", "100000", None),
    ],
)
def test_cgroup_quota_in_whole_cpus(quota, period, want):
    assert cpu_threads._quota_cpus(quota, period) == want


@pytest.mark.parametrize("value", [0, -2, 1.5, "4"])
def test_cpu_threads_is_validated(value):
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=value)


def test_flag_reaches_the_config():
    args = build_parser().parse_args(["generate", "--cpu-threads", "3"])
    assert args.cpu_threads == 3


def test_explicit_threads_are_set_on_cpu(restore_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    apply_cpu_threads(EngineConfig(device="cpu", cpu_threads=1))
    assert torch.get_num_threads() == 1


def test_the_first_cpu_engine_chooses_for_the_process(restore_threads, monkeypatch, caplog):
    """torch's thread count is process-wide and compiled decoders guard on it: a later engine
    that changed it would make every earlier one recompile (refused)."""
    torch.set_num_threads(2)
    f = torch.compile(lambda x: x * 2, backend="eager")
    apply_cpu_threads(EngineConfig(device="cpu", cpu_threads=1))
    f(torch.ones(2))
    apply_cpu_threads(EngineConfig(device="cpu", cpu_threads=2))
    apply_cpu_threads(EngineConfig(device="cpu"))
    assert torch.get_num_threads() == 1 and "cpu_threads=2 ignored" in caplog.text
    with torch.compiler.set_stance("fail_on_recompile"):
        f(torch.ones(2))


def test_omp_num_threads_is_kept(restore_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    monkeypatch.setattr(CpuInfo, "probe", classmethod(lambda cls: pytest.fail("probed")))
    apply_cpu_threads(EngineConfig(device="cpu"))
    assert torch.get_num_threads() == 1


def test_default_is_applied_without_omp_num_threads(restore_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    busy = CpuInfo(allowed=2, physical=2, online=2, load=1.2)
    monkeypatch.setattr(CpuInfo, "probe", classmethod(lambda cls: busy))
    torch.set_num_threads(2)
    apply_cpu_threads(EngineConfig(device="cpu"))
    assert torch.get_num_threads() == 1


def test_import_and_config_leave_torch_threads_alone():
    code = (
        "import torch\ntorch.set_num_threads(1)\nimport pcgspec\n"
        "from pcgspec import LLM\nfrom pcgspec.config import EngineConfig\n"
        "EngineConfig(device='cpu', cpu_threads=2)\nassert torch.get_num_threads() == 1"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr


def test_a_cuda_engine_leaves_cpu_threads_alone(restore_threads):
    torch.set_num_threads(2)
    apply_cpu_threads(SimpleNamespace(torch_device=torch.device("cuda"), cpu_threads=1))
    assert torch.get_num_threads() == 2
