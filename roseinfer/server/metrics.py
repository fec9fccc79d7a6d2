"""Prometheus metrics (``roseinfer:*``) in a per-app registry.

Gauges and counters are read from the AsyncEngine's stats snapshot when scraped
(a custom collector), so the engine keeps one source of truth. Latency histograms
are fed by a step observer that runs on the engine thread (prometheus_client
metrics are thread-safe). ``stream_aborts_total{reason}`` counts streams the server
ended early: ``stalled`` (the client read nothing for ``--stream-stall-timeout``) and
``disconnected``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from roseinfer.engine.async_engine import AsyncEngine
from roseinfer.engine.request_stream import StepTimings
from roseinfer.engine.stats import EngineStats

PREFIX = "roseinfer:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the latest stats snapshot."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        g.add_metric([self._model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([self._model], value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        yield self._gauge("num_requests_running", "Sequences in the running batch.",
                          s.num_running)
        yield self._gauge("num_requests_waiting", "Sequences waiting to be scheduled.",
                          s.num_waiting)
        yield self._gauge("num_requests_held",
                          "Sequences not scheduled because their stream's client is not "
                          "reading (backpressure).", s.num_held)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                          s.kv_cache_usage)
        yield self._gauge("kv_cache_free_blocks", "KV blocks not used by any request.",
                          s.num_free_blocks)
        yield self._gauge("kv_cache_total_blocks", "KV blocks in the pool.", s.num_total_blocks)
        yield self._gauge("engine_healthy", "1 while the engine loop is serving.",
                          1.0 if self._engine.healthy else 0.0)
        yield self._counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens_total)
        yield self._counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield self._counter("num_preemptions", "Requests preempted (to be recomputed).",
                            s.num_preemptions)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                            s.prefix_cache_hits)
        yield from _kv_disk_metrics(s, self)
        yield from _spec_decode_metrics(s, self._model)
        success = CounterMetricFamily(PREFIX + "request_success",
                                      "Finished sequences by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted({"stop", "length", "abort", *s.finished}):
            success.add_metric([self._model, reason], s.finished.get(reason, 0))
        yield success


def _kv_disk_metrics(s: EngineStats, c: _EngineCollector) -> Iterator[Metric]:
    """The persistent prefix cache (``--kv-cache-dir``; zeros while it is off)."""
    yield c._counter("kv_disk_cache_hits", "Prompt tokens whose KV was loaded from disk.",
                     s.kv_disk_hit_tokens)
    yield c._counter("kv_disk_cache_misses", "Block lookups on disk that found nothing.",
                     s.kv_disk_misses)
    yield c._counter("kv_disk_cache_read_bytes", "Bytes of KV blocks read from disk.",
                     s.kv_disk_read_bytes)
    yield c._counter("kv_disk_cache_written_bytes", "Bytes of KV blocks written to disk.",
                     s.kv_disk_written_bytes)
    yield c._counter("kv_disk_cache_rejected", "Block files ignored: corrupt, truncated or "
                     "of another model.", s.kv_disk_rejected)


def _spec_decode_metrics(s: EngineStats, model: str) -> Iterator[Metric]:
    """Speculative decoding (vLLM's names; zeros while it is off or has not drafted)."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Verifications of a request's drafts.",
         s.spec_decode_num_drafts),
        ("spec_decode_num_draft_tokens", "Drafted tokens verified.",
         s.spec_decode_num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
         s.spec_decode_num_accepted_tokens),
    ):
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([model], value)
        yield c
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Drafted tokens accepted, by position in the draft (0 = first).",
                                  labels=["model_name", "position"])
    for pos, value in enumerate(s.spec_decode_accepted_per_pos):
        per_pos.add_metric([model, str(pos)], value)
    yield per_pos
    rate = GaugeMetricFamily(PREFIX + "spec_decode_acceptance_rate",
                             "Accepted / drafted tokens since the start (0-1).",
                             labels=["model_name"])
    rate.add_metric([model], s.spec_decode_acceptance_rate)
    yield rate


class ServerMetrics:
    """The app's registry: engine collector plus latency histograms."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first token.", buckets=TTFT_BUCKETS,
                              **labels).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between two tokens of one request.", buckets=ITL_BUCKETS,
                             **labels).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the last token.", buckets=E2E_BUCKETS,
                             **labels).labels(model_name)
        self.stream_aborts = Counter(PREFIX + "stream_aborts",
                                     "Streams ended before their last token, by reason "
                                     "(stalled: the client read nothing for the stall "
                                     "timeout; disconnected: it left).",
                                     labelnames=["model_name", "reason"],
                                     registry=self.registry)
        self._model = model_name
        for reason in ("stalled", "disconnected"):
            self.stream_aborts.labels(model_name, reason)
        engine.add_observer(self.observe)

    def stream_aborted(self, reason: str) -> None:
        """A stream ended early (``StreamResponse``): its request was aborted."""
        self.stream_aborts.labels(self._model, reason).inc()

    def observe(self, timings: StepTimings) -> None:
        for value in timings.ttft:
            self.ttft.observe(value)
        for value in timings.itl:
            self.itl.observe(value)
        for value in timings.e2e:
            self.e2e.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
