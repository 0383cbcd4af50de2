"""Prometheus metrics of the API's defences: dropped frames, admission, drain.

Read at scrape time from the engine client and the admission control, like
``metrics._RankCollector``, so nothing has to keep them in sync.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.api.admission import Admission
from services.api.engine_client import EngineClient


class ReliabilityCollector(Collector):
    def __init__(self, engine_client: EngineClient, admission: Admission, model_name: str) -> None:
        self._client = engine_client
        self._admission = admission
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        name = self._model_name
        engine_frames = CounterMetricFamily(
            "weft:engine_dropped_frames", "Malformed input frames an engine core dropped (since it started).",
            labels=["model_name", "engine"])
        for rank, stats in sorted(self._client.rank_stats().items()):
            engine_frames.add_metric([name, str(rank)], stats.num_dropped_frames)
        api_frames = CounterMetricFamily(
            "weft:api_dropped_frames", "Malformed frames the API dropped, by socket.",
            labels=["model_name", "socket"])
        for socket_name, count in sorted(self._client.dropped_frames().items()):
            api_frames.add_metric([name, socket_name], count)
        rejected = CounterMetricFamily(
            "weft:requests_rejected", "Requests refused with 503, by reason.", labels=["model_name", "reason"])
        for reason, count in sorted(self._admission.num_rejected.items()):
            rejected.add_metric([name, reason], count)
        in_use = GaugeMetricFamily("weft:admitted_sequences", "Engine requests admitted and not yet ended.",
                                   labels=["model_name"])
        in_use.add_metric([name], self._admission.in_use)
        capacity = GaugeMetricFamily("weft:admission_capacity", "Engine requests the ready ranks may hold.",
                                     labels=["model_name"])
        capacity.add_metric([name], self._admission.capacity())
        yield from (engine_frames, api_frames, rejected, in_use, capacity)
