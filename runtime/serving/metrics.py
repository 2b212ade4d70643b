"""Prometheus metrics of one server (`GET /metrics`).

Each app gets its own `CollectorRegistry`, so several servers (or test apps) in one
process never share or clash over counters. Request counts and latency histograms are
recorded by the request handlers; engine gauges (queue, running sequences, KV blocks,
prefix-cache hit rate, compiled buckets) are read from the engine's stats snapshot at
scrape time, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.runtime.serving.async_engine import AsyncLLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector(Collector):
    """Gauges read from the engine at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, cache_info: Callable[[], dict[str, int]]):
        self.engine = engine
        self.cache_info = cache_info

    def collect(self) -> Iterable[Any]:
        s = self.engine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("kiln_num_requests_waiting", "Requests queued that have not produced a token yet",
                    self.engine.num_waiting_requests)
        yield gauge("kiln_num_sequences_waiting", "Sequences in the scheduler's waiting queue", s.num_waiting_seqs)
        yield gauge("kiln_num_sequences_running", "Sequences in the running batch", s.num_running_seqs)
        yield gauge("kiln_kv_blocks_in_use", "KV-cache blocks held by live sequences", s.kv_blocks_used)
        yield gauge("kiln_kv_blocks_total", "Usable KV-cache blocks", s.kv_blocks_total)
        yield gauge("kiln_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield gauge("kiln_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up",
                    s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        yield gauge("kiln_num_guided_requests", "Requests whose output is constrained by a grammar",
                    s.num_guided_requests)
        yield CounterMetricFamily("kiln_engine_steps", "Engine steps run", value=s.num_steps)
        yield CounterMetricFamily("kiln_preemptions", "Sequences preempted for lack of KV blocks",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("kiln_engine_step_failures", "Engine steps that raised (their requests failed)",
                                  value=s.num_step_failures)
        buckets = GaugeMetricFamily("kiln_compiled_buckets", "Compiled graph buckets by where they came from",
                                    labels=["source"])
        for source, count in sorted(self.cache_info().items()):
            buckets.add_metric([source], count)
        yield buckets


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, cache_info: Callable[[], dict[str, int]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kiln_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.time_to_first_token = Histogram("kiln_time_to_first_token_seconds",
                                             "Time from arrival to the first output token",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("kiln_time_per_output_token_seconds",
                                               "Time per output token after the first",
                                               buckets=_TPOT_BUCKETS, registry=r)
        self.e2e_latency = Histogram("kiln_e2e_request_latency_seconds", "Time from arrival to the last token",
                                     buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of requests served", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated", registry=r)
        self.aborted = Counter("kiln_requests_aborted", "Requests aborted because the client went away",
                               registry=r)
        r.register(_EngineCollector(engine, cache_info or (lambda: {})))

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def record_finished(self, ttft: float | None, tpot: float | None, e2e: float | None,
                        prompt_tokens: int, generation_tokens: int) -> None:
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
        if tpot is not None:
            self.time_per_output_token.observe(tpot)
        if e2e is not None:
            self.e2e_latency.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
