"""Prometheus metrics of one server (`GET /metrics`), named after vLLM's.

Every metric vLLM has an equivalent of carries vLLM's name and meaning with the `kiln:`
prefix instead of `vllm:`, and a `model_name` label (the first served name), so dashboards
built for vLLM work by swapping the prefix (the mapping is in README.md, "Coming from
vLLM"). Kiln's own metrics (compiled buckets, engine steps, KV blocks) use the same prefix.

Each app gets its own `CollectorRegistry`, so several servers (or test apps) in one
process never share or clash over counters. Request counts and latency histograms are
recorded by the request handlers; engine gauges and counters (queue, running sequences, KV
usage, prefix-cache queries and hits, preemptions, compiled buckets) are read from the
engine's stats snapshot at scrape time, so they are never stale and cost nothing between
scrapes. `StatsLogger` writes vLLM's periodic throughput / KV-usage line while serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.runtime.serving.async_engine import AsyncLLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "kiln:"
logger = logging.getLogger("kiln.serving")

# vLLM's bucket boundaries.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# Kiln metric -> vLLM metric, as exposed (README.md "Coming from vLLM" lists the same; a test
# checks every name here is served).
VLLM_NAMES: dict[str, str] = {
    "kiln:num_requests_running": "vllm:num_requests_running",
    "kiln:num_requests_waiting": "vllm:num_requests_waiting",
    "kiln:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "kiln:prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "kiln:prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "kiln:num_preemptions_total": "vllm:num_preemptions_total",
    "kiln:prompt_tokens_total": "vllm:prompt_tokens_total",
    "kiln:generation_tokens_total": "vllm:generation_tokens_total",
    "kiln:request_success_total": "vllm:request_success_total",
    "kiln:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "kiln:time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "kiln:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "kiln:request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "kiln:request_prompt_tokens": "vllm:request_prompt_tokens",
    "kiln:request_generation_tokens": "vllm:request_generation_tokens",
}


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, cache_info: Callable[[], dict[str, int]]):
        self.engine = engine
        self.model_name = model_name
        self.cache_info = cache_info

    def collect(self) -> Iterable[Any]:
        s = self.engine.stats
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        # vLLM's.
        yield gauge("num_requests_running", "Sequences in the running batch (vLLM: requests running)",
                    s.num_running_seqs)
        yield gauge("num_requests_waiting", "Requests queued that have not started yet",
                    self.engine.num_waiting_requests)
        yield gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent (blocks held by live sequences)",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits)
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks", s.num_preemptions)
        # Kiln's own.
        yield gauge("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start",
                    s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        yield gauge("num_sequences_waiting", "Sequences in the scheduler's waiting queue", s.num_waiting_seqs)
        yield gauge("kv_blocks_in_use", "KV-cache blocks held by live sequences", s.kv_blocks_used)
        yield gauge("kv_blocks_total", "Usable KV-cache blocks", s.kv_blocks_total)
        yield gauge("num_guided_requests", "Requests whose output is constrained by a grammar", s.num_guided_requests)
        yield counter("engine_steps", "Engine steps run", s.num_steps)
        yield counter("engine_step_failures", "Engine steps that raised (their requests failed)", s.num_step_failures)
        buckets = GaugeMetricFamily(PREFIX + "compiled_buckets", "Compiled graph buckets by where they came from",
                                    labels=["model_name", "source"])
        for source, count in sorted(self.cache_info().items()):
            buckets.add_metric([self.model_name, source], count)
        yield buckets


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, cache_info: Callable[[], dict[str, int]] | None = None,
                 model_name: str = "kiln"):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.requests = Counter(PREFIX + "http_requests", "HTTP requests by endpoint and status code",
                                ["model_name", "endpoint", "status"], registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=r)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "Time from arrival to the first output token", m,
                                             buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.time_per_output_token = Histogram(PREFIX + "time_per_output_token_seconds",
                                               "Time per output token after the first", m,
                                               buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token",
                                     m, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time from arrival to first being scheduled", m, buckets=_E2E_BUCKETS,
                                    registry=r).labels(model_name)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request", m,
                                               buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Generated tokens per request", m, buckets=_TOKEN_BUCKETS,
                                                   registry=r).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests served", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", m,
                                         registry=r).labels(model_name)
        self.aborted = Counter(PREFIX + "requests_aborted", "Requests aborted because the client went away", m,
                               registry=r).labels(model_name)
        r.register(_EngineCollector(engine, model_name, cache_info or (lambda: {})))

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(model_name=self.model_name, endpoint=endpoint, status=str(status)).inc()

    def record_finished(self, ttft: float | None, tpot: float | None, e2e: float | None,
                        prompt_tokens: int, generation_tokens: int, *, queue_time: float | None = None,
                        finish_reasons: list[str | None] | None = None) -> None:
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
        if tpot is not None:
            self.time_per_output_token.observe(tpot)
        if e2e is not None:
            self.e2e_latency.observe(e2e)
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        for reason in finish_reasons or []:
            if reason is not None:
                self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class _Totals:
    time: float
    prompt_tokens: float
    generation_tokens: float


class StatsLogger:
    """vLLM's periodic line while serving: prompt and generation throughput over the last
    interval, running / waiting requests, KV-cache usage, prefix-cache hit rate."""

    def __init__(self, metrics: ServerMetrics, engine: AsyncLLMEngine, interval: float = 10.0):
        self.metrics = metrics
        self.engine = engine
        self.interval = interval
        self._last = self._totals()

    def _totals(self) -> _Totals:
        return _Totals(time.monotonic(), self.metrics.prompt_tokens._value.get(),
                       self.metrics.generation_tokens._value.get())

    def line(self) -> str:
        """The line for the interval since the previous call."""
        now, s = self._totals(), self.engine.stats
        elapsed = max(now.time - self._last.time, 1e-9)
        prompt_tps = (now.prompt_tokens - self._last.prompt_tokens) / elapsed
        gen_tps = (now.generation_tokens - self._last.generation_tokens) / elapsed
        self._last = now
        kv = 100.0 * s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        hit = 100.0 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
                f"tokens/s, Running: {s.num_running_seqs} reqs, Waiting: {self.engine.num_waiting_requests} reqs, "
                f"KV cache usage: {kv:.1f}%, Prefix cache hit rate: {hit:.1f}%")

    async def run(self) -> None:
        """Log `line()` every `interval` seconds while anything happened (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval)
            before = (self._last.prompt_tokens, self._last.generation_tokens)
            text = self.line()
            busy = self.engine.stats.num_running_seqs or self.engine.num_waiting_requests
            if busy or (self._last.prompt_tokens, self._last.generation_tokens) != before:
                logger.info("%s", text)
