"""Prometheus metrics of the API's defences: dropped frames, admission, drain.

Declared as one table, like ``metrics.RANK_FAMILIES``, and read at scrape
time from the engine client and the admission control, so nothing has to
keep them in sync. (The frames an engine dropped are a rank stat: they are
a row of ``RANK_FAMILIES``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from services.api.admission import Admission
from services.api.engine_client import EngineClient
from services.api.metrics import Family, add_sample, metric_family

# (label values after model_name, value) pairs, from (engine client, admission).
Reader = Callable[[EngineClient, Admission], Iterable[tuple[tuple[str, ...], float]]]

RELIABILITY_FAMILIES: tuple[tuple[Family, Reader], ...] = (
    (
        Family(
            "weft:api_dropped_frames",
            "counter",
            "Malformed frames the API dropped, by socket.",
            extra_labels=("socket",),
        ),
        lambda client, _: (((name,), count) for name, count in sorted(client.dropped_frames().items())),
    ),
    (
        Family(
            "weft:requests_rejected",
            "counter",
            "Requests refused with 503, by reason.",
            extra_labels=("reason",),
        ),
        lambda _, admission: (((reason,), count) for reason, count in sorted(admission.num_rejected.items())),
    ),
    (
        Family("weft:admitted_sequences", "gauge", "Engine requests admitted and not yet ended."),
        lambda _, admission: [((), admission.in_use)],
    ),
    (
        Family("weft:admission_capacity", "gauge", "Engine requests the ready ranks may hold."),
        lambda _, admission: [((), admission.capacity())],
    ),
)


class ReliabilityCollector(Collector):
    def __init__(self, engine_client: EngineClient, admission: Admission, model_name: str) -> None:
        self._client = engine_client
        self._admission = admission
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family, read in RELIABILITY_FAMILIES:
            metric = metric_family(family, ["model_name", *family.extra_labels])
            for label_values, value in read(self._client, self._admission):
                add_sample(metric, family, [self._model_name, *label_values], value, 0)
            yield metric
