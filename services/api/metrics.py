"""Prometheus metrics under vLLM's names, labels and buckets, on a private registry.

Every metric is declared once, as a row of one of two tables:

- ``RANK_FAMILIES``: read from ``engine_client.rank_stats()`` at scrape time
  (per-rank load, and the running totals the API sums from the engines'
  stats deltas), so nothing has to keep them in sync;
- ``REQUEST_FAMILIES``: observed by the routes through ``RequestMetrics``,
  one per engine request (tokens, latencies, finish reasons).

Registration, the stat each row reads and what ``/metrics`` serves all come
from these rows: adding a metric is adding a row (plus, for an engine stat,
its ``SchedulerStats`` field, whose running total the API keeps by itself:
``protocol.engine.SCHEDULER_STATS_DELTAS``). ``services.api.reliability_metrics``
declares the API's defences the same way.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from protocol import EngineConfig, EngineCoreEventType, EngineCoreOutput, SamplingParams
from protocol.engine import ITERATION_TOKENS_BUCKETS
from protocol.structured_outputs import COMPILE_TIME_BUCKETS, StructuredOutputStats
from services.api.engine_client import RankStats
from services.api.tracing import RequestTimes

if TYPE_CHECKING:
    from services.api.tracing import Tracer

# vLLM does the same: the `*_created` series only double what scrapers see.
# (A process-wide switch; the API process owns its metrics.)
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")  # vLLM's labels on every family

_TTFT_BUCKETS = (
    0.001,
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
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
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
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_LATENCY_BUCKETS = (
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
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_N_BUCKETS = (1, 2, 5, 10, 20)
# Token-count histograms use 1-2-5 buckets up to max_model_len (vLLM's
# build_1_2_5_buckets); this marks them in the tables.
MODEL_LEN_BUCKETS = "1-2-5 up to max_model_len"

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Family:
    """One metric: its exposed name (counters gain ``_total``), kind, help and labels."""

    name: str
    kind: Kind
    doc: str
    extra_labels: tuple[str, ...] = ()  # after model_name and engine
    buckets: tuple[float, ...] | str | None = None  # histograms only

    def bucket_bounds(self, max_model_len: int) -> tuple[float, ...]:
        if self.buckets == MODEL_LEN_BUCKETS:
            return one_two_five_buckets(max_model_len)
        assert isinstance(self.buckets, tuple), f"{self.name}: only histograms have buckets"
        return self.buckets


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    bounds: list[int] = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(bounds)
            bounds.append(value)
    raise AssertionError("unreachable")


def _histogram_of(
    counts: list[int], total: float, bounds: tuple[float, ...]
) -> tuple[list[tuple[str, float]], float]:
    """(cumulative buckets, sum) for a HistogramMetricFamily from per-bucket counts."""
    counts = counts or [0] * (len(bounds) + 1)
    edges = [*map(floatToGoString, bounds), "+Inf"]
    return list(zip(edges, itertools.accumulate(counts), strict=True)), total


def _structured(stats: RankStats) -> StructuredOutputStats:
    return stats.structured_outputs or StructuredOutputStats()


# Read from each rank's RankStats at scrape time. A reader returns the value,
# a list (one sample per index of the one extra label), or, for histograms,
# (per-bucket counts, sum).
Sample = float | list[int] | list[float] | tuple[Sequence[int], float]
RANK_FAMILIES: tuple[tuple[Family, Callable[[RankStats], Sample]], ...] = (
    (
        Family("vllm:num_requests_running", "gauge", "Requests running on the engine."),
        lambda s: s.num_running,
    ),
    (
        Family("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
        lambda s: s.num_waiting,
    ),
    (Family("vllm:kv_cache_usage_perc", "gauge", "KV cache usage, 0 to 1."), lambda s: s.kv_cache_usage),
    (
        Family("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
        lambda s: s.totals.prefix_cache_queries,
    ),
    (
        Family("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
        lambda s: s.totals.prefix_cache_hits,
    ),
    (
        Family("vllm:num_preemptions", "counter", "Requests preempted by the scheduler."),
        lambda s: s.totals.num_preemptions,
    ),
    (
        Family(
            "vllm:external_prefix_cache_queries", "counter", "Prompt tokens a KV connector offered to load."
        ),
        lambda s: s.totals.external_prefix_cache_queries,
    ),
    (
        Family(
            "vllm:external_prefix_cache_hits",
            "counter",
            "Prompt tokens loaded by a KV connector instead of computed.",
        ),
        lambda s: s.totals.external_prefix_cache_hits,
    ),
    (
        Family("vllm:spec_decode_num_drafts", "counter", "Request steps that verified draft tokens."),
        lambda s: s.totals.spec_decode_num_drafts,
    ),
    (
        Family("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens verified."),
        lambda s: s.totals.spec_decode_num_draft_tokens,
    ),
    (
        Family("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted."),
        lambda s: s.totals.spec_decode_num_accepted_tokens,
    ),
    (
        Family(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "counter",
            "Draft tokens accepted, by draft position.",
            extra_labels=("position",),
        ),
        lambda s: s.totals.spec_decode_num_accepted_tokens_per_pos,
    ),
    (
        Family(
            "vllm:iteration_tokens_total",
            "histogram",
            "Histogram of number of tokens per engine_step.",
            buckets=ITERATION_TOKENS_BUCKETS,
        ),
        lambda s: (s.totals.iteration_tokens_counts, s.totals.iteration_tokens_sum),
    ),
    (
        Family("weft:structured_output_requests", "counter", "Requests with a structured-output constraint."),
        lambda s: _structured(s).num_requests,
    ),
    (
        Family(
            "weft:structured_output_compile_seconds",
            "histogram",
            "Time to compile a request's grammar.",
            buckets=COMPILE_TIME_BUCKETS,
        ),
        lambda s: (_structured(s).compile_counts, _structured(s).compile_seconds),
    ),
    (
        Family(
            "weft:engine_dropped_frames",
            "counter",
            "Malformed input frames an engine core dropped (since it started).",
        ),
        lambda s: s.num_dropped_frames,
    ),
)

# Observed by RequestMetrics, labelled by the engine that served the request.
REQUEST_FAMILIES: tuple[Family, ...] = (
    Family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    Family("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    Family(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        extra_labels=("finished_reason",),
    ),
    Family(
        "vllm:request_prompt_tokens",
        "histogram",
        "Number of prefill tokens processed.",
        buckets=MODEL_LEN_BUCKETS,
    ),
    Family(
        "vllm:request_generation_tokens",
        "histogram",
        "Number of generation tokens processed.",
        buckets=MODEL_LEN_BUCKETS,
    ),
    Family("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", buckets=_N_BUCKETS),
    Family(
        "vllm:request_params_max_tokens",
        "histogram",
        "Histogram of the max_tokens request parameter.",
        buckets=MODEL_LEN_BUCKETS,
    ),
    Family(
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Histogram of time to first token in seconds.",
        buckets=_TTFT_BUCKETS,
    ),
    Family(
        "vllm:inter_token_latency_seconds",
        "histogram",
        "Histogram of inter-token latency in seconds.",
        buckets=_ITL_BUCKETS,
    ),
    # vLLM's earlier name of the inter-token latency, which dashboards still query.
    Family(
        "vllm:time_per_output_token_seconds",
        "histogram",
        "Histogram of time per output token in seconds (the inter-token latency's earlier name).",
        buckets=_ITL_BUCKETS,
    ),
    Family(
        "vllm:request_time_per_output_token_seconds",
        "histogram",
        "Histogram of time_per_output_token_seconds per request.",
        buckets=_ITL_BUCKETS,
    ),
    Family(
        "vllm:e2e_request_latency_seconds",
        "histogram",
        "Histogram of e2e request latency in seconds.",
        buckets=_LATENCY_BUCKETS,
    ),
    Family(
        "vllm:request_queue_time_seconds",
        "histogram",
        "Histogram of time spent in WAITING phase for request.",
        buckets=_LATENCY_BUCKETS,
    ),
    Family(
        "vllm:request_inference_time_seconds",
        "histogram",
        "Histogram of time spent in RUNNING phase for request.",
        buckets=_LATENCY_BUCKETS,
    ),
    Family(
        "vllm:request_prefill_time_seconds",
        "histogram",
        "Histogram of time spent in PREFILL phase for request.",
        buckets=_LATENCY_BUCKETS,
    ),
    Family(
        "vllm:request_decode_time_seconds",
        "histogram",
        "Histogram of time spent in DECODE phase for request.",
        buckets=_LATENCY_BUCKETS,
    ),
)

CACHE_CONFIG_INFO = Family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")


MetricFamily = CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily
_FAMILY_CLASSES: dict[Kind, type[MetricFamily]] = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "histogram": HistogramMetricFamily,
}


def metric_family(family: Family, labels: list[str]) -> MetricFamily:
    """An empty scrape-time family for a table row."""
    return _FAMILY_CLASSES[family.kind](family.name, family.doc, labels=labels)


def add_sample(
    metric: MetricFamily, family: Family, label_values: list[str], value: Sample, max_model_len: int
) -> None:
    if isinstance(metric, HistogramMetricFamily):  # the family's kind is histogram
        assert isinstance(value, tuple), f"{family.name}: a histogram reads (counts, sum)"
        counts, total = value
        buckets, total = _histogram_of(list(counts), total, family.bucket_bounds(max_model_len))
        metric.add_metric(label_values, buckets, total)
    elif isinstance(value, list):  # one sample per index of the extra label
        for index, item in enumerate(value):
            metric.add_metric([*label_values, str(index)], item)
    else:
        assert not isinstance(value, tuple), f"{family.name}: only histograms read (counts, sum)"
        metric.add_metric(label_values, value)


class _RankCollector(Collector):
    """Reads each rank's stats when Prometheus scrapes."""

    def __init__(
        self, rank_stats: Callable[[], dict[int, RankStats]], model_name: str, config: EngineConfig | None
    ) -> None:
        self._rank_stats = rank_stats
        self._model_name = model_name
        self._config = config

    def collect(self) -> Iterator[Metric]:
        ranks = sorted(self._rank_stats().items())
        for family, read in RANK_FAMILIES:
            metric = metric_family(family, [*LABELS, *family.extra_labels])
            for rank, stats in ranks:
                add_sample(metric, family, [self._model_name, str(rank)], read(stats), 0)
            yield metric
        if self._config is not None:
            yield self._cache_config_info(self._config, ranks)

    @staticmethod
    def _cache_config_info(config: EngineConfig, ranks: list[tuple[int, RankStats]]) -> Metric:
        """An info gauge (always 1) whose labels are the cache config, per rank (vLLM's way)."""
        cache = {
            name: str(value)
            for name, value in ((f, getattr(config.cache, f)) for f in config.cache.__struct_fields__)
        }
        labels = [*sorted(cache), "num_gpu_blocks", "engine"]
        metric = GaugeMetricFamily(CACHE_CONFIG_INFO.name, CACHE_CONFIG_INFO.doc, labels=labels)
        for rank, stats in ranks:
            metric.add_metric([*(cache[k] for k in sorted(cache)), str(stats.num_blocks), str(rank)], 1)
        return metric


class APIMetrics:
    def __init__(
        self,
        rank_stats: Callable[[], dict[int, RankStats]],
        model_name: str,
        config: EngineConfig | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.max_model_len = config.model.max_model_len if config is not None else 65536
        self.registry.register(_RankCollector(rank_stats, model_name, config))
        self.families = {f.name: self._register(f) for f in REQUEST_FAMILIES}
        self.tracer: Tracer | None = None  # --otlp-traces-endpoint: a span per finished request

    def _register(self, family: Family) -> Counter | Gauge | Histogram:
        labels = [*LABELS, *family.extra_labels]
        if family.kind == "histogram":
            return Histogram(
                family.name,
                family.doc,
                labels,
                registry=self.registry,
                buckets=family.bucket_bounds(self.max_model_len),
            )
        cls = Counter if family.kind == "counter" else Gauge
        return cls(family.name, family.doc, labels, registry=self.registry)

    def observe(self, name: str, value: float, engine: int, **extra: str) -> None:
        family = self.families[name]
        assert isinstance(family, Histogram), f"{name} is not a histogram"
        family.labels(model_name=self.model_name, engine=str(engine), **extra).observe(value)

    def inc(self, name: str, value: float, engine: int, **extra: str) -> None:
        family = self.families[name]
        assert not isinstance(family, Histogram), f"{name} is a histogram"
        family.labels(model_name=self.model_name, engine=str(engine), **extra).inc(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def request(
        self,
        num_prompt_tokens: int,
        arrival_time: float,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> RequestMetrics:
        """``params``: the request's own parameters (``n``, ``max_tokens``), given
        to exactly one of its engine requests, which observes them once. ``request_id``
        and ``sampling`` (this engine request's parameters) go into its trace span."""
        metrics = RequestMetrics(self, num_prompt_tokens, arrival_time, params)
        if self.tracer is not None:
            metrics.trace = (self.tracer, self.tracer.current_parent(), request_id, sampling)
        return metrics


class RequestMetrics:
    """Observes one engine request's outputs. API times are ``time.monotonic()``;
    engine times (events, output timestamps) are only compared with each other."""

    def __init__(
        self,
        metrics: APIMetrics,
        num_prompt_tokens: int,
        arrival_time: float,
        params: SamplingParams | None = None,
    ) -> None:
        self._m = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._arrival = arrival_time
        self._params = params
        self._engine = 0
        self._num_generated = 0
        self._last_output: float | None = None
        self._queued: float | None = None
        self._scheduled: float | None = None  # the first scheduling (a preemption does not move it)
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._first_token_api: float | None = None
        # (tracer, parent context, request id, sampling params)
        self.trace: tuple[Tracer, object, str | None, SamplingParams | None] | None = None

    def on_output(self, output: EngineCoreOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._engine = output.engine_index
        self._observe_events(output)
        if not output.new_token_ids:
            return
        m, engine = self._m, self._engine
        if self._last_output is None:
            m.inc("vllm:prompt_tokens", self._num_prompt_tokens, engine)
            m.observe("vllm:time_to_first_token_seconds", now - self._arrival, engine)
            self._first_token = output.timestamp
            self._first_token_api = now
        else:
            for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
                m.observe(name, now - self._last_output, engine)
        self._last_output = now
        self._last_token = output.timestamp
        self._num_generated += len(output.new_token_ids)
        m.inc("vllm:generation_tokens", len(output.new_token_ids), engine)

    def on_finish(self, finish_reason: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m, engine = self._m, self._engine
        m.inc("vllm:request_success", 1, engine, finished_reason=finish_reason)
        m.observe("vllm:e2e_request_latency_seconds", now - self._arrival, engine)
        m.observe("vllm:request_prompt_tokens", self._num_prompt_tokens, engine)
        m.observe("vllm:request_generation_tokens", self._num_generated, engine)
        if self._params is not None:
            m.observe("vllm:request_params_n", self._params.n, engine)
            if self._params.max_tokens is not None:
                m.observe("vllm:request_params_max_tokens", self._params.max_tokens, engine)
        self._observe_phases()
        if self.trace is not None:
            self._record_span(now)

    def _record_span(self, now: float) -> None:
        assert self.trace is not None
        tracer, parent, request_id, sampling = self.trace
        times = RequestTimes(
            self._arrival,
            now,
            self._first_token_api,
            self._queued,
            self._scheduled,
            self._first_token,
            self._last_token,
        )
        attributes: dict[str, object] = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": self._m.model_name,
            "gen_ai.usage.prompt_tokens": self._num_prompt_tokens,
            "gen_ai.usage.completion_tokens": self._num_generated,
            "weft.engine": self._engine,
        }
        if sampling is not None:
            attributes |= {
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.n": self._params.n if self._params is not None else None,
            }
        tracer.record(attributes, times, parent)

    def _observe_phases(self) -> None:
        """vLLM's phases, on the engine's clock: prefill = scheduled -> first token,
        decode = first -> last token, inference = scheduled -> last token."""
        m, engine = self._m, self._engine
        if self._scheduled is None or self._first_token is None or self._last_token is None:
            return  # never ran (aborted while queued, or refused); the first and last tokens come together
        decode = max(0.0, self._last_token - self._first_token)
        m.observe("vllm:request_prefill_time_seconds", max(0.0, self._first_token - self._scheduled), engine)
        m.observe("vllm:request_decode_time_seconds", decode, engine)
        m.observe("vllm:request_inference_time_seconds", max(0.0, self._last_token - self._scheduled), engine)
        if self._num_generated > 1:
            tpot = decode / (self._num_generated - 1)
            m.observe("vllm:request_time_per_output_token_seconds", tpot, engine)

    def _observe_events(self, output: EngineCoreOutput) -> None:
        for event in output.events or ():
            if event.type == EngineCoreEventType.QUEUED and self._queued is None:
                self._queued = event.timestamp
            elif (
                event.type == EngineCoreEventType.SCHEDULED
                and self._queued is not None
                and self._scheduled is None
            ):
                self._scheduled = event.timestamp
                self._m.observe(
                    "vllm:request_queue_time_seconds", max(0.0, event.timestamp - self._queued), self._engine
                )
