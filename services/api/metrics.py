"""Prometheus metrics under vLLM's names, on a private registry.

Per-rank load (running, waiting, KV usage) and the engines' running totals
(prefix cache, preemptions) are read from ``engine_client.rank_stats()`` at
scrape time by a custom collector, so nothing has to keep them in sync.
Per-request numbers (tokens, latencies, finish reasons) are observed by the
routes through ``RequestMetrics``, one per engine request.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol import EngineCoreEventType, EngineCoreOutput
from protocol.structured_outputs import COMPILE_TIME_BUCKETS, StructuredOutputStats
from services.api.engine_client import RankStats

# vLLM does the same: the `*_created` series only double what scrapers see.
# (A process-wide switch; the API process owns its metrics.)
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _RankCollector(Collector):
    """Reads each rank's stats when Prometheus scrapes."""

    def __init__(self, rank_stats: Callable[[], dict[int, RankStats]], model_name: str) -> None:
        self._rank_stats = rank_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        families = {
            "num_requests_running": GaugeMetricFamily(
                "vllm:num_requests_running", "Requests running on the engine.", labels=labels),
            "num_requests_waiting": GaugeMetricFamily(
                "vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels=labels),
            "kv_cache_usage_perc": GaugeMetricFamily(
                "vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1.", labels=labels),
            "prefix_cache_queries": CounterMetricFamily(
                "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=labels),
            "prefix_cache_hits": CounterMetricFamily(
                "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=labels),
            "num_preemptions": CounterMetricFamily(
                "vllm:num_preemptions", "Requests preempted by the scheduler.", labels=labels),
            "external_prefix_cache_queries": CounterMetricFamily(
                "vllm:external_prefix_cache_queries", "Prompt tokens a KV connector offered to load.",
                labels=labels),
            "external_prefix_cache_hits": CounterMetricFamily(
                "vllm:external_prefix_cache_hits", "Prompt tokens loaded by a KV connector instead of computed.",
                labels=labels),
            **_spec_decode_families(labels),
        }
        for rank, stats in sorted(self._rank_stats().items()):
            values = {
                "num_requests_running": stats.num_running,
                "num_requests_waiting": stats.num_waiting,
                "kv_cache_usage_perc": stats.kv_cache_usage,
                "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "num_preemptions": stats.num_preemptions,
                "external_prefix_cache_queries": stats.external_prefix_cache_queries,
                "external_prefix_cache_hits": stats.external_prefix_cache_hits,
                "spec_decode_num_drafts": stats.spec_decode_num_drafts,
                "spec_decode_num_draft_tokens": stats.spec_decode_num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.spec_decode_num_accepted_tokens,
            }
            for key, value in values.items():
                families[key].add_metric([self._model_name, str(rank)], value)
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                families["spec_decode_num_accepted_tokens_per_pos"].add_metric(
                    [self._model_name, str(rank), str(position)], count)
        yield from families.values()
        yield from _structured_output_families(self._rank_stats(), labels, self._model_name)


def _structured_output_families(ranks: dict[int, RankStats], labels: list[str],
                                model_name: str) -> Iterator[Metric]:
    """Constrained requests and grammar compile times, from each rank's running totals."""
    requests = CounterMetricFamily("weft:structured_output_requests",
                                   "Requests with a structured-output constraint.", labels=labels)
    compile_time = HistogramMetricFamily("weft:structured_output_compile_seconds",
                                         "Time to compile a request's grammar.", labels=labels)
    for rank, stats in sorted(ranks.items()):
        totals = stats.structured_outputs or StructuredOutputStats()
        label_values = [model_name, str(rank)]
        requests.add_metric(label_values, totals.num_requests)
        counts = totals.compile_counts or [0] * (len(COMPILE_TIME_BUCKETS) + 1)
        bounds = [*map(str, COMPILE_TIME_BUCKETS), "+Inf"]
        compile_time.add_metric(label_values, list(zip(bounds, itertools.accumulate(counts))),
                                totals.compile_seconds)
    yield requests
    yield compile_time


def _spec_decode_families(labels: list[str]) -> dict[str, CounterMetricFamily]:
    """Speculative decoding counters (zero while it is off), vLLM's names."""
    return {
        "spec_decode_num_drafts": CounterMetricFamily(
            "vllm:spec_decode_num_drafts", "Request steps that verified draft tokens.", labels=labels),
        "spec_decode_num_draft_tokens": CounterMetricFamily(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels=labels),
        "spec_decode_num_accepted_tokens": CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels=labels),
        "spec_decode_num_accepted_tokens_per_pos": CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
            labels=[*labels, "position"]),
    }


class APIMetrics:
    def __init__(self, rank_stats: Callable[[], dict[int, RankStats]], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(_RankCollector(rank_stats, model_name))
        reg, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", label, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       label + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", label,
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive outputs.",
                             label, buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", label,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time spent queued in the engine.",
                                    label, buckets=_LATENCY_BUCKETS, registry=reg)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def request(self, num_prompt_tokens: int, arrival_time: float) -> RequestMetrics:
        return RequestMetrics(self, num_prompt_tokens, arrival_time)


class RequestMetrics:
    """Observes one engine request's outputs; times are ``time.monotonic()``."""

    def __init__(self, metrics: APIMetrics, num_prompt_tokens: int, arrival_time: float) -> None:
        self._m = metrics
        self._labels = {"model_name": metrics.model_name}
        self._num_prompt_tokens = num_prompt_tokens
        self._arrival = arrival_time
        self._last_output: float | None = None
        self._queued: float | None = None
        self._queue_time_seen = False

    def on_output(self, output: EngineCoreOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._observe_events(output)
        if not output.new_token_ids:
            return
        if self._last_output is None:
            self._m.prompt_tokens.labels(**self._labels).inc(self._num_prompt_tokens)
            self._m.ttft.labels(**self._labels).observe(now - self._arrival)
        else:
            self._m.itl.labels(**self._labels).observe(now - self._last_output)
        self._last_output = now
        self._m.generation_tokens.labels(**self._labels).inc(len(output.new_token_ids))

    def on_finish(self, finish_reason: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._m.request_success.labels(finished_reason=finish_reason, **self._labels).inc()
        self._m.e2e.labels(**self._labels).observe(now - self._arrival)

    def _observe_events(self, output: EngineCoreOutput) -> None:
        # Engine timestamps are only comparable with each other (another clock).
        for event in output.events or ():
            if event.type == EngineCoreEventType.QUEUED and self._queued is None:
                self._queued = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and self._queued is not None \
                    and not self._queue_time_seen:
                self._queue_time_seen = True
                self._m.queue_time.labels(**self._labels).observe(max(0.0, event.timestamp - self._queued))
