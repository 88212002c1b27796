"""Prometheus metrics of a :class:`~kvstrata.manager.KvBlockManager`.

Each manager owns a :class:`ManagerMetrics` with its own ``CollectorRegistry`` by default (not
the process-global one), so several managers, and tests, never collide. Values are updated
by the manager's owner thread; scraping reads them from any thread (prometheus_client is
thread-safe). Names (all prefixed ``kvstrata_``; see docs/manager.md):

========================================  =========  ===================  =====================
name                                      type       labels               meaning
========================================  =========  ===================  =====================
``kvstrata_tier_capacity_blocks``         gauge      tier                 slots of the tier
``kvstrata_tier_capacity_bytes``          gauge      tier                 bytes of its storage
``kvstrata_tier_blocks``                  gauge      tier, state          slots by state:
                                                                          active / inactive /
                                                                          reset
``kvstrata_tier_evictions_total``         counter    tier                 blocks evicted
``kvstrata_offload_blocks_total``         counter    path                 blocks offloaded
``kvstrata_offload_bytes_total``          counter    path                 bytes offloaded
``kvstrata_onboard_blocks_total``         counter    path                 blocks onboarded
``kvstrata_onboard_bytes_total``          counter    path                 bytes onboarded
``kvstrata_offload_skipped_blocks_total`` counter    tier, reason         not copied:
                                                                          ``admission`` /
                                                                          ``evicted`` (left
                                                                          the source while
                                                                          deferred) /
                                                                          ``no_slot``
``kvstrata_lookup_blocks_total``          counter    (none)               blocks asked for by
                                                                          ``onboard``
``kvstrata_hit_blocks_total``             counter    tier                 blocks of onboarded
                                                                          prefixes, by the
                                                                          tier that served them
``kvstrata_transfer_seconds``             histogram  path                 submit -> completion
``kvstrata_transfer_failed_blocks_total`` counter    path, kind           failed blocks
``kvstrata_checksum_failures_total``      counter    tier                 checksum mismatches
``kvstrata_transfers_in_flight``          gauge      (none)               plans submitted,
                                                                          queued or deferred
========================================  =========  ===================  =====================
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from prometheus_client.metrics import MetricWrapperBase

from .httpserve import BoundedHTTPServer, BoundedRequestHandler
from .placement.telemetry import PlacementListener
from .protocol.results import FailureKind
from .tiers import is_onboard, split_path

PREFIX = "kvstrata_"

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)


class ManagerMetrics(PlacementListener):
    """The Prometheus collectors of one manager, registered in :attr:`registry`; a
    :class:`~kvstrata.placement.PlacementListener` of its planner. Paths towards a faster
    tier count as onboard, the others as offload.

    ``registry`` defaults to a fresh ``CollectorRegistry``; pass
    ``prometheus_client.REGISTRY`` to publish through the global one.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = None   # created unregistered, registered together below
        self.capacity_blocks = Gauge(f"{PREFIX}tier_capacity_blocks", "Slots of a tier",
                                     ["tier"], registry=r)
        self.capacity_bytes = Gauge(f"{PREFIX}tier_capacity_bytes",
                                    "Bytes allocated for a tier's storage", ["tier"], registry=r)
        self.tier_blocks = Gauge(f"{PREFIX}tier_blocks", "Slots of a tier by state",
                                 ["tier", "state"], registry=r)
        self.evictions = Counter(f"{PREFIX}tier_evictions", "Blocks evicted from a tier",
                                 ["tier"], registry=r)
        self.offload_blocks = Counter(f"{PREFIX}offload_blocks", "Blocks offloaded",
                                      ["path"], registry=r)
        self.offload_bytes = Counter(f"{PREFIX}offload_bytes", "Bytes offloaded", ["path"],
                                     registry=r)
        self.onboard_blocks = Counter(f"{PREFIX}onboard_blocks", "Blocks onboarded", ["path"],
                                      registry=r)
        self.onboard_bytes = Counter(f"{PREFIX}onboard_bytes", "Bytes onboarded", ["path"],
                                     registry=r)
        self.skipped_blocks = Counter(
            f"{PREFIX}offload_skipped_blocks",
            "Blocks not copied to a tier (admission refused, source evicted while deferred, "
            "no slot)", ["tier", "reason"], registry=r)
        self.lookups = Counter(f"{PREFIX}lookup_blocks", "Blocks asked for by onboard",
                               registry=r)
        self.hits = Counter(f"{PREFIX}hit_blocks",
                            "Blocks of onboarded prefixes, by the tier that served them",
                            ["tier"], registry=r)
        self.latency = Histogram(f"{PREFIX}transfer_seconds",
                                 "Transfer latency from submit to completion", ["path"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.failed_blocks = Counter(f"{PREFIX}transfer_failed_blocks",
                                     "Blocks whose transfer failed", ["path", "kind"], registry=r)
        self.checksum_failures = Counter(f"{PREFIX}checksum_failures",
                                         "Blocks whose bytes did not match their checksum",
                                         ["tier"], registry=r)
        self.transfers_in_flight = Gauge(f"{PREFIX}transfers_in_flight",
                               "Transfer plans submitted, queued or deferred, not completed",
                               registry=r)
        self._collectors = [v for v in vars(self).values() if isinstance(v, MetricWrapperBase)]
        self._registered: list[MetricWrapperBase] = []
        try:
            for collector in self._collectors:
                self.registry.register(collector)
                self._registered.append(collector)
        except BaseException:
            self._unregister()   # a clash in a shared registry leaves nothing behind
            raise
        self._evictions_seen: dict[str, int] = {}
        self._server = None

    # -- updates (owner thread) ----------------------------------------------------------
    def set_capacity(self, tier: str, blocks: int, nbytes: int) -> None:
        self.capacity_blocks.labels(tier).set(blocks)
        self.capacity_bytes.labels(tier).set(nbytes)

    def set_pool(self, tier: str, active: int, inactive: int, reset: int, evictions: int) -> None:
        """Publish a pool's slot counts; ``evictions`` is the pool's running total."""
        self.tier_blocks.labels(tier, "active").set(active)
        self.tier_blocks.labels(tier, "inactive").set(inactive)
        self.tier_blocks.labels(tier, "reset").set(reset)
        seen = self._evictions_seen.get(tier, 0)
        if evictions > seen:
            self.evictions.labels(tier).inc(evictions - seen)
            self._evictions_seen[tier] = evictions

    # -- what the planner reports (PlacementListener, owner thread) ----------------------
    def transfer_done(self, path: str, blocks: int, nbytes: int, busy_seconds: float,
                      latency_seconds: float, failures: Iterable[tuple[str, int]]) -> None:
        """One plan completed: ``blocks``/``nbytes`` that arrived, its latency (hand-out to
        result), and ``(kind, count)`` of the blocks that failed."""
        source, target = split_path(path)
        if is_onboard(source, target):
            self.onboard_blocks.labels(path).inc(blocks)
            self.onboard_bytes.labels(path).inc(nbytes)
        else:
            self.offload_blocks.labels(path).inc(blocks)
            self.offload_bytes.labels(path).inc(nbytes)
        self.latency.labels(path).observe(latency_seconds)
        for kind, count in failures:
            self.failed_blocks.labels(path, kind).inc(count)
            if kind == FailureKind.CHECKSUM_MISMATCH.value:
                self.checksum_failures.labels(source).inc(count)

    def skipped(self, tier: str, reason: str, count: int) -> None:
        """``count`` blocks offered to ``tier`` were not copied, for ``reason``."""
        if count:
            self.skipped_blocks.labels(tier, reason).inc(count)

    def onboarded(self, requested: int, sources: Sequence[str]) -> None:
        """An onboard asked for ``requested`` blocks; ``sources`` names each hit's tier."""
        self.lookups.inc(requested)
        for tier, count in collections.Counter(sources).items():
            self.hits.labels(tier).inc(count)

    def in_flight(self, pending: int) -> None:
        self.transfers_in_flight.set(pending)

    # -- reading -------------------------------------------------------------------------
    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (``name`` as exposed, e.g. ``kvstrata_hit_blocks_total``);
        0.0 if absent. Meant for tests and reports; works after :meth:`close` too."""
        for collector in self._collectors:
            for metric in collector.collect():
                for sample in metric.samples:
                    if sample.name == name and sample.labels == labels:
                        return sample.value
        return 0.0

    # -- HTTP endpoint -------------------------------------------------------------------
    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose ``/metrics`` on ``addr:port`` (0 picks a free port); returns the port. The
        server is :class:`~kvstrata.httpserve.BoundedHTTPServer`: bounded per request and
        in threads (prometheus_client's own server is neither)."""
        registry = self.registry

        class Handler(BoundedRequestHandler):
            def log_message(self, fmt, *args):  # quiet
                pass

            def do_GET(self):
                if self.path.split("?", 1)[0].rstrip("/") not in ("", "/metrics"):
                    self.send_error(404, "use GET /metrics")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = BoundedHTTPServer((addr, port), Handler).start("kvstrata-metrics-http")
        return self._server.server_address[1]

    def close(self) -> None:
        """Stop the HTTP endpoint if one was started and unregister the collectors (so a
        shared registry can take the next manager's). Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._unregister()

    def _unregister(self) -> None:
        while self._registered:
            self.registry.unregister(self._registered.pop())
