"""bench_serving.py's ``mixed`` dataset: short chat streams alone, then beside long prompts,
against a real CPU server; its option checks and its percentiles."""

from __future__ import annotations

import json

import pytest
from script_modules import script_module
from server_process import MODEL, bench_launch_flags


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_serving") as module:
        yield module


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--long-rate", "0"], "--long-rate must be > 0"),
        (["--long-prompt-tokens", "0"], "--long-prompt-tokens must be >= 1"),
        (["--mixed-seconds", "-1"], "--mixed-seconds must be > 0"),
        (["--duration", "3"], "--dataset mixed is a single run"),
    ],
)
def test_mixed_options_are_checked(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(["--dataset", "mixed", *argv])
    assert message in capsys.readouterr().err


def test_mixed_percentiles_and_ratios(bench):
    from serving_mixed import dist_ms, gaps, long_prompt, ratios
    from serving_sweep import Stream

    stream = Stream(0, 0.0, chunks=[(0.1, 1), (0.2, 1), (0.5, 1), (0.6, 1)])
    assert gaps(stream) == pytest.approx([0.1, 0.3, 0.1])
    d = dist_ms([0.001 * i for i in range(1, 201)])
    assert d["p50_ms"] == pytest.approx(100.5) and d["p99_ms"] == pytest.approx(199.0)
    assert d["max_ms"] == pytest.approx(200.0) and dist_ms([]) == {}
    point = {"short": {"itl": {"p99_ms": 10.0, "max_ms": 20.0}, "ttft": {"p99_ms": 5.0}}}
    slow = {"short": {"itl": {"p99_ms": 30.0, "max_ms": 80.0}, "ttft": {}}}
    assert ratios(point, slow) == {"itl_p99": 3.0, "itl_max": 4.0, "ttft_p99": None}
    import random

    a, b = long_prompt(random.Random(0), 50), long_prompt(random.Random(1), 50)
    assert a != b and len(a.split()) == 50 + 5


def test_mixed_against_a_cpu_server(bench, tmp_path, capsys, monkeypatch):
    """Two short streams for 2.5 s alone, then 2.5 s beside a 300-token prompt every 0.5 s."""
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")  # NOTE: starts the server sooner
    out = tmp_path / "mixed.json"
    bench.main(
        [
            *bench_launch_flags(tmp_path),
            "--dataset",
            "mixed",
            "--max-concurrency",
            "2",
            "--long-prompt-tokens",
            "300",
            "--long-rate",
            "2",
            "--long-max-tokens",
            "2",
            "--mixed-seconds",
            "2.5",
            "--max-tokens",
            "12",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["model"] == MODEL and "--dataset mixed" in written["command"]
    report = written["mixed"]
    assert (report["concurrency"], report["long_prompt_tokens"], report["long_rate"]) == (2, 300, 2)
    assert list(report["points"]) == ["baseline", "mixed"]
    for name, point in report["points"].items():
        short = point["short"]
        assert short["requests"] >= 2 and short["failed"] == 0, name
        assert point["errors"] == [] and point["seconds"] >= 2.5, name
        itl, ttft = short["itl"], short["ttft"]
        assert 0 < itl["p50_ms"] <= itl["p99_ms"] <= itl["max_ms"], name
        assert 0 < ttft["p50_ms"] <= ttft["p99_ms"] <= ttft["max_ms"], name
        assert short["output_tok_s"] > 0, name
    baseline, mixed = report["points"]["baseline"]["long"], report["points"]["mixed"]["long"]
    assert baseline["sent"] == 0 and baseline["ttft"] == {}
    assert mixed["sent"] == 5 and mixed["completed"] == 5 and mixed["failed"] == 0
    assert 300 <= mixed["prompt_tokens_mean"] < 512
    assert 0 < mixed["ttft"]["p50_ms"] <= mixed["ttft"]["max_ms"]
    assert set(report["ratios"]) == {"itl_p99", "itl_max", "ttft_p99"}
    assert all(v > 0 for v in report["ratios"].values())
    table = capsys.readouterr().out
    assert "Short streams beside long prompts" in table and "mixed / baseline" in table
