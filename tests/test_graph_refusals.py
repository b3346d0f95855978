"""Every graph runner refuses through one guard and counts its refusals one way (refusals.py);
the server exports them per runner and reason in /server_info and /metrics.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pcgspec.runners.decode_graph_runner import DecodeGraphRunner
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.runners.extend_graph_runner import ExtendGraphRunner
from pcgspec.runners.piecewise_runner import PiecewiseRunner
from pcgspec.runners.refusals import GraphStats, GuardedRunner, hit_ratio
from pcgspec.server.engine_loop import EngineSnapshot
from pcgspec.server.metrics import ServerMetrics, graph_summary


class _Bounded(GuardedRunner):
    reasons = ("too_big",)

    def _refusal(self, batch: int) -> str | None:
        return "too_big" if batch > 4 else ("odd" if batch < 0 else None)

    @property
    def num_graphs(self) -> int:
        return 1

    def run(self, batch: int) -> None:
        self._count_run(padded_rows=4 - batch)


def test_can_run_counts_each_refusal_by_reason() -> None:
    runner = _Bounded()
    assert runner.stats() == {"graphs": 1, "runs": 0, "padded_rows": 0, "fallbacks": {"too_big": 0}}
    assert hit_ratio(runner.stats()) is None
    for batch in (1, 3, 9, 7):
        if runner.can_run(batch):
            runner.run(batch)
    stats = runner.stats()
    assert stats == {"graphs": 1, "runs": 2, "padded_rows": 4, "fallbacks": {"too_big": 2}}
    assert hit_ratio(stats) == 0.5
    with pytest.raises(RuntimeError, match="'odd'"):  # a reason the runner does not declare
        runner.can_run(-1)


def test_every_graph_runner_uses_the_one_guard() -> None:
    for cls in (PiecewiseRunner, ExtendGraphRunner, DecodeGraphRunner, DraftGraphRunner):
        assert issubclass(cls, GuardedRunner) and cls.reasons, cls
        assert "can_run" not in vars(cls) and "stats" not in vars(cls), cls


def _stats(runs: int, **fallbacks: int) -> GraphStats:
    return GraphStats(graphs=4, runs=runs, padded_rows=0, fallbacks=fallbacks)


def test_metrics_and_server_info_carry_every_runner_and_reason() -> None:
    graphs = {
        "verify": _stats(6, batch_size=2, mode=0),
        "draft": _stats(0, seq_len=1),
        "piecewise": _stats(3, target_verify=0),
    }
    metrics = ServerMetrics("m", lambda: EngineSnapshot(graphs=graphs))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(f"pcgspec:{name}", tuple(sorted({"model_name": "m", **labels}.items())))]

    assert value("graph_fallbacks_total", runner="verify", reason="batch_size") == 2
    assert value("graph_fallbacks_total", runner="verify", reason="mode") == 0
    assert value("graph_fallbacks_total", runner="draft", reason="seq_len") == 1
    assert value("graph_runs_total", runner="verify") == 6
    assert value("graph_hit_ratio", runner="verify") == 0.75
    assert value("graph_hit_ratio", runner="draft") == 0
    summary = graph_summary(graphs)
    assert summary["verify"]["hit_ratio"] == 0.75 and summary["piecewise"]["hit_ratio"] == 1
    assert summary["draft"]["fallbacks"] == {"seq_len": 1}
