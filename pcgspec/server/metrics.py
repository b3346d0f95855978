"""Prometheus metrics of one server, on a registry of its own (never the global one).

Request latencies are histograms observed as deltas reach the event loop. A sequence's time to
first token is the sum of the server's part before the hand-off (body, parsing, tokenizing), the
dispatch to the engine, the engine's queue and prefill, and the return of the token; the
engine's stamps are ``time.perf_counter`` (the host's monotonic clock, one for every process)
taken in the engine process. Engine state (running / waiting, KV usage, speculative accept
length, every graph runner's runs and fallbacks) is read from the engine's latest snapshot when
``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pcgspec.runners.refusals import GraphStats, hit_ratio
from pcgspec.server.deltas import SeqDelta

if TYPE_CHECKING:
    from pcgspec.server.async_engine import EngineSnapshot, RequestStream

PREFIX = "pcgspec:"
_TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_HOP_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0)
_E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        kw = {"labelnames": labels, "registry": self.registry}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, **kw).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between two deliveries of tokens "
            "to one request (one engine step, several tokens with speculation).",
            _ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _E2E_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds",
            "Engine-side: a sequence's arrival at the engine to its first prefill step.",
            _TTFT_BUCKETS,
        )
        self.prefill_time = hist(
            "request_prefill_time_seconds",
            "Engine-side: a sequence's first prefill step to its first token read back "
            "(under the overlap schedule one step after the step that sampled it).",
            _TTFT_BUCKETS,
        )
        self.dispatch_time = hist(
            "request_dispatch_time_seconds",
            "A sequence's hand-off to the engine to its arrival there (the pipe to the engine "
            "process, and the wait for the step it is running to end).",
            _HOP_BUCKETS,
        )
        self.return_time = hist(
            "request_return_time_seconds",
            "A sequence's first token read back by the engine to its delivery on the server's "
            "event loop (the rest of that step, the pipe back, the event loop's queue).",
            _HOP_BUCKETS,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", **kw
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", **kw
        ).labels(model_name)
        self.requests = Counter(
            PREFIX + "request_success",
            "Finished sequences by reason.",
            labelnames=[*labels, "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.registry.register(_EngineCollector(model_name, snapshot))

    def observe(
        self, stream: RequestStream, deltas: Sequence[SeqDelta], final: bool, now: float
    ) -> None:
        """One delivery of deltas to ``stream`` (before the stream records it)."""
        tokens = sum(len(d.token_ids) for d in deltas)
        if tokens:
            if stream.first_token_time is None:
                self.ttft.observe(now - stream.arrival)
            elif stream.last_token_time is not None:
                self.itl.observe(now - stream.last_token_time)
            self.generation_tokens.inc(tokens)
        for d in deltas:
            if d.finish_reason is not None:
                self.requests.labels(self.model_name, d.finish_reason).inc()
            if d.first_token is not None:
                times = d.first_token
                self.queue_time.observe(times.queue_s)
                self.prefill_time.observe(times.prefill_s)
                if stream.submitted is not None:
                    self.dispatch_time.observe(times.arrival - stream.submitted)
                self.return_time.observe(now - times.read_back)
        if final:
            self.e2e.observe(now - stream.arrival)
            self.prompt_tokens.inc(stream.num_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine gauges and counters, read from the latest snapshot at scrape time."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        stats, labels = snap.stats, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Sequences decoding.", stats.get("num_running", 0))
        yield gauge(
            "num_requests_waiting", "Sequences queued or mid-prefill.", stats.get("num_waiting", 0)
        )
        total = stats.get("kv_pages_total", 0)
        used = stats.get("kv_pages_used", 0)
        yield gauge(
            "kv_cache_usage_perc",
            "Share of KV pages requests hold (0..1; pages only the prefix cache holds are free).",
            used / total if total else 0.0,
        )
        yield gauge("kv_cache_used_pages", "KV pages held by requests.", used)
        accept = snap.spec.get("avg_spec_accept_length")
        yield gauge(
            "spec_accept_length",
            "Accepted drafts + 1 per verify step, averaged (0 without speculation).",
            accept or 0.0,
        )
        yield from self._graphs(snap)
        yield from self._speculative(snap)
        yield from self._prefix_cache(snap)
        counter = CounterMetricFamily(
            PREFIX + "num_preemptions", "Preempted sequences.", labels=["model_name"]
        )
        counter.add_metric(labels, stats.get("num_preemptions", 0))
        yield counter
        aborted = CounterMetricFamily(
            PREFIX + "num_aborted_requests", "Aborted requests.", labels=["model_name"]
        )
        aborted.add_metric(labels, snap.num_aborted)
        yield aborted

    def _speculative(self, snap: EngineSnapshot) -> Iterator[Metric]:
        """Decode steps by kind: speculative, and plain ones the policy chose (none without
        speculation).
        """
        steps = CounterMetricFamily(
            PREFIX + "spec_decode_steps",
            "Decode steps with speculation on: speculative, or plain as the policy chose.",
            labels=["model_name", "kind"],
        )
        for kind, key in (("speculative", "speculative_steps"), ("plain", "policy_plain_steps")):
            steps.add_metric([self.model_name, kind], snap.spec.get(key, 0))
        yield steps

    def _prefix_cache(self, snap: EngineSnapshot) -> Iterator[Metric]:
        """Prefix-cache counters (zero with ``--disable-radix-cache``)."""
        cache, labels = snap.cache, [self.model_name]
        for name, key, doc in (
            (
                "prefix_cache_queried_tokens",
                "prompt_tokens",
                "Tokens looked up in the prefix cache (prompts, resumed sequences).",
            ),
            ("prefix_cache_hit_tokens", "cached_tokens", "Looked-up tokens the cache served."),
            ("prefix_cache_evicted_tokens", "evicted_tokens", "Tokens evicted from the cache."),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(labels, cache.get(key, 0))
            yield counter
        for name, key, doc in (
            ("prefix_cache_hit_rate", "hit_rate", "Hit tokens / queried tokens (0..1)."),
            ("prefix_cache_tokens", "tree_tokens", "Tokens held by the prefix cache."),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric(labels, cache.get(key, 0))
            yield gauge

    def _graphs(self, snap: EngineSnapshot) -> Iterator[Metric]:
        """Every graph runner's runs, eager fallbacks by reason and hit ratio (runner: piecewise,
        extend, decode, verify, draft, draft_piecewise; those the engine built).
        """
        labels = ["model_name", "runner"]
        runs = CounterMetricFamily(
            PREFIX + "graph_runs", "Passes a graph runner served.", labels=labels
        )
        hits = GaugeMetricFamily(
            PREFIX + "graph_hit_ratio",
            "Passes a graph runner served / those offered to it (0 before the first).",
            labels=labels,
        )
        fallbacks = CounterMetricFamily(
            PREFIX + "graph_fallbacks",
            "Passes a graph runner refused (run another way, mostly eagerly), by reason.",
            labels=[*labels, "reason"],
        )
        for runner, stats in snap.graphs.items():
            runs.add_metric([self.model_name, runner], stats["runs"])
            hits.add_metric([self.model_name, runner], hit_ratio(stats) or 0.0)
            for reason, n in stats["fallbacks"].items():
                fallbacks.add_metric([self.model_name, runner, reason], n)
        yield from (runs, hits, fallbacks)


def graph_summary(graphs: dict[str, GraphStats]) -> dict[str, dict[str, Any]]:
    """``Engine.graph_stats()`` with each runner's hit ratio (None before its first offer)."""
    return {name: {**stats, "hit_ratio": hit_ratio(stats)} for name, stats in graphs.items()}
