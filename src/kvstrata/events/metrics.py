"""Prometheus collectors for event publishers (optional; needs ``prometheus_client``).

Metric names (labels ``worker_id``, ``sink``):

* ``kvstrata_events_enqueued_total`` - events produced by the registry hooks
* ``kvstrata_events_published_total`` - events handed to the sink successfully
* ``kvstrata_events_dropped_total`` - events lost (buffer full, sink error, closed)
* ``kvstrata_events_batches_total`` - batches handed to the sink
* ``kvstrata_events_sink_errors_total`` - failed sink calls (each retry counts)
* ``kvstrata_events_lag`` - events buffered, not yet delivered (gauge)
* ``kvstrata_events_lag_seconds`` - age of the oldest buffered event (gauge)
* ``kvstrata_events_last_event_id`` - last event id assigned (gauge)
"""

from __future__ import annotations

import weakref

COUNTERS = ("enqueued", "published", "dropped", "batches", "sink_errors")
GAUGES = ("lag", "lag_seconds", "last_event_id")
PREFIX = "kvstrata_events_"


class PublisherCollector:
    """Collects the metrics of every publisher added to it (held weakly)."""

    def __init__(self) -> None:
        self._publishers: "weakref.WeakSet" = weakref.WeakSet()

    def add(self, publisher) -> None:
        self._publishers.add(publisher)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["worker_id", "sink"]
        fams = {n: CounterMetricFamily(PREFIX + n, f"kvstrata event publisher: {n}", labels=labels) for n in COUNTERS}
        fams.update({n: GaugeMetricFamily(PREFIX + n, f"kvstrata event publisher: {n}", labels=labels) for n in GAUGES})
        for pub in list(self._publishers):
            values = pub.metrics()
            lv = [str(pub.identity.worker_id), pub.sink.describe()]
            for name, fam in fams.items():
                fam.add_metric(lv, values[name])
        yield from fams.values()


_default: PublisherCollector | None = None


def register_publisher(publisher, registry=None) -> PublisherCollector:
    """Expose ``publisher``'s metrics through ``registry`` (default: the global REGISTRY).

    One collector per registry is created on first use and reused after.
    """
    global _default
    from prometheus_client import REGISTRY

    if registry is None or registry is REGISTRY:
        if _default is None:
            _default = PublisherCollector()
            REGISTRY.register(_default)
        collector = _default
    else:
        collector = PublisherCollector()
        registry.register(collector)
    collector.add(publisher)
    return collector
