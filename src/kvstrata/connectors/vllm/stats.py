"""The connector's counters in vLLM's stats logger and Prometheus endpoint.

The scheduler half counts (:class:`~kvstrata.connectors.vllm.scheduler.ConnectorCounters`);
each step it hands vLLM the increase since the last step as a :class:`KvStrataStats`, which
vLLM aggregates, logs ("KV Transfer metrics") and passes to :class:`KvStrataPromMetrics`:

* ``vllm:kvstrata_tokens_matched{tier}`` -- prompt tokens answered as loadable, by tier;
* ``vllm:kvstrata_blocks_loaded{tier}`` -- blocks loaded into vLLM's KV cache, by source tier;
* ``vllm:kvstrata_blocks_load_failed`` -- blocks promised but not loaded (recomputed);
* ``vllm:kvstrata_blocks_offered`` -- full blocks offered to G2 (stored unless already held);
* ``vllm:kvstrata_requests_held`` -- finished requests whose blocks a store still read;
* ``vllm:kvstrata_blocks_not_stored{tier, reason}`` -- blocks a tier did not take: its
  admission filter refused them, or (``no_slot``) every free slot was in flight;
* ``vllm:kvstrata_tokens_not_loaded{tier}`` -- prompt tokens held in a tier but recomputed
  because the cost model estimated loading them slower;
* ``vllm:kvstrata_writes_held_seconds{tier}`` -- seconds writes to a lower tier were held
  back while the engine's forward ran (``yield_to_forward``);

with tenant quotas (:mod:`kvstrata.placement.tenants`), per tenant label (a tenant the config
names, or ``*`` for all the others together: a tenant key can be a secret cache salt):

* ``vllm:kvstrata_tenant_tokens_matched{tenant}`` -- prompt tokens answered as loadable;
* ``vllm:kvstrata_tenant_blocks_evicted{tier, tenant}`` -- blocks a tenant's own stores
  evicted to stay in its quota;
* ``vllm:kvstrata_tenant_blocks_refused{tier, tenant}`` -- blocks not stored, their tenant at
  its quota with nothing of its own idle to evict;
* ``vllm:kvstrata_tenant_blocks{tier, tenant}`` (gauge) -- blocks held now;

and, as gauges, what the cost model (:mod:`kvstrata.placement.costs`) estimates now, sent
when an estimate moved by more than 1 % since last sent:

* ``vllm:kvstrata_path_bandwidth_bytes_per_second{path}`` and
  ``vllm:kvstrata_path_overhead_seconds{path}`` -- per path (``G3->G1``);
* ``vllm:kvstrata_prefill_tokens_per_second`` -- the engine's prefill rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

__all__ = ["KvStrataStats", "KvStrataPromMetrics", "delta", "estimates", "moved"]

_BY_TIER = ("tokens_matched", "blocks_loaded", "blocks_not_stored", "tokens_not_loaded",
            "writes_held_seconds", "tenant_tokens_matched", "tenant_blocks_evicted",
            "tenant_blocks_refused")
_PLAIN = ("blocks_load_failed", "blocks_offered", "requests_held")


def _empty() -> dict[str, Any]:
    return {**{k: {} for k in _BY_TIER}, **{k: 0 for k in _PLAIN}}


def estimates(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The gauges' values from a ``CostModel.snapshot()``."""
    paths = snapshot.get("paths", {})
    return {"bandwidth": {p: v["bandwidth_bytes_per_s"] for p, v in paths.items()},
            "overhead": {p: v["overhead_seconds"] for p, v in paths.items()},
            "prefill": snapshot.get("prefill_tokens_per_s", 0.0)}


def moved(now: dict[str, Any], sent: dict[str, Any] | None, tolerance: float = 0.01) -> bool:
    """Whether any estimate in ``now`` differs from ``sent`` by more than ``tolerance``."""
    if sent is None:
        return True

    def far(a: float, b: float | None) -> bool:
        return b is None or abs(a - b) > tolerance * max(abs(a), abs(b), 1e-12)

    return far(now["prefill"], sent.get("prefill")) or any(
        far(v, sent.get(key, {}).get(path))
        for key in ("bandwidth", "overhead") for path, v in now[key].items())


def delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``now - before`` for two counter snapshots (``ConnectorCounters.as_dict``)."""
    out = _empty()
    for key in _BY_TIER:
        for tier, n in now.get(key, {}).items():
            d = n - before.get(key, {}).get(tier, 0)
            if d:
                out[key][tier] = d
    for key in _PLAIN:
        out[key] = now.get(key, 0) - before.get(key, 0)
    return out


@dataclass
class KvStrataStats(KVConnectorStats):
    """Counter increases (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> "KvStrataStats":
        for gauges in ("estimates", "tenant_blocks"):   # gauges: the later report wins
            if other.data.get(gauges):
                self.data[gauges] = other.data[gauges]
        for key in _BY_TIER:
            mine = self.data.setdefault(key, {})
            for tier, n in other.data.get(key, {}).items():
                mine[tier] = mine.get(tier, 0) + n
        for key in _PLAIN:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key in _BY_TIER:
            for tier, n in sorted(self.data.get(key, {}).items()):
                out[f"{key}_{tier}"] = n
        for key in _PLAIN:
            out[key] = self.data.get(key, 0)
        est = self.data.get("estimates")
        if est:
            out["prefill_tokens_per_s"] = est["prefill"]
            for path, v in sorted(est["bandwidth"].items()):
                out[f"bandwidth_MBps_{path}"] = round(v / 1e6, 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _BY_TIER) and \
            not any(self.data.get(k) for k in _PLAIN) and not self.data.get("estimates") \
            and not self.data.get("tenant_blocks")


class KvStrataPromMetrics(KVConnectorPromMetrics):
    """kvstrata's counters in vLLM's Prometheus registry."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls
        self._by_tier = {
            key: counter(name=f"vllm:kvstrata_{key}", documentation=doc,
                         labelnames=labelnames + ["tier"])
            for key, doc in (("tokens_matched", "Prompt tokens kvstrata offered to load, by tier"),
                             ("blocks_loaded", "Blocks kvstrata loaded into the KV cache, by tier"),
                             ("tokens_not_loaded", "Prompt tokens kvstrata held but left to "
                              "recompute (estimated faster), by tier"),
                             ("writes_held_seconds", "Seconds kvstrata held writes to a tier "
                              "back while the engine's forward ran"))}
        self._not_stored = counter(name="vllm:kvstrata_blocks_not_stored",
                                   documentation="Blocks a kvstrata tier did not take, by reason",
                                   labelnames=labelnames + ["tier", "reason"])
        self._plain = {
            key: counter(name=f"vllm:kvstrata_{key}", documentation=doc, labelnames=labelnames)
            for key, doc in (("blocks_load_failed", "Blocks kvstrata promised but did not load"),
                             ("blocks_offered", "Full blocks kvstrata offered to its host tier"),
                             ("requests_held", "Finished requests held while stores ran"))}
        gauge = self._gauge_cls
        self._bandwidth = gauge(name="vllm:kvstrata_path_bandwidth_bytes_per_second",
                                documentation="kvstrata's estimated copy bandwidth, by path",
                                labelnames=labelnames + ["path"], multiprocess_mode="mostrecent")
        self._overhead = gauge(name="vllm:kvstrata_path_overhead_seconds",
                               documentation="kvstrata's estimated per-plan overhead, by path",
                               labelnames=labelnames + ["path"], multiprocess_mode="mostrecent")
        self._prefill = gauge(name="vllm:kvstrata_prefill_tokens_per_second",
                              documentation="The engine's prefill rate as kvstrata measures it",
                              labelnames=labelnames, multiprocess_mode="mostrecent")
        self._tenant_matched = counter(name="vllm:kvstrata_tenant_tokens_matched",
                                       documentation="Prompt tokens kvstrata offered to load, "
                                       "by tenant ('*': tenants the config does not name)",
                                       labelnames=labelnames + ["tenant"])
        self._by_tenant = {
            key: counter(name=f"vllm:kvstrata_{key}", documentation=doc,
                         labelnames=labelnames + ["tier", "tenant"])
            for key, doc in (("tenant_blocks_evicted", "Blocks of its own a tenant's stores "
                              "evicted to stay in its quota, by tier and tenant"),
                             ("tenant_blocks_refused", "Blocks not stored: their tenant was at "
                              "its quota, by tier and tenant"))}
        self._tenant_held = gauge(name="vllm:kvstrata_tenant_blocks",
                                  documentation="Blocks kvstrata holds now, by tier and tenant",
                                  labelnames=labelnames + ["tier", "tenant"],
                                  multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, metric in self._by_tier.items():
            for tier, n in transfer_stats_data.get(key, {}).items():
                if n:
                    metric.labels(*labels, tier).inc(n)
        for key, n in transfer_stats_data.get("blocks_not_stored", {}).items():
            tier, _, reason = key.partition(":")
            if n:
                self._not_stored.labels(*labels, tier, reason).inc(n)
        for key, metric in self._plain.items():
            n = transfer_stats_data.get(key, 0)
            if n:
                metric.labels(*labels).inc(n)
        for label, n in transfer_stats_data.get("tenant_tokens_matched", {}).items():
            if n:
                self._tenant_matched.labels(*labels, label).inc(n)
        for key, metric in self._by_tenant.items():
            for where, n in transfer_stats_data.get(key, {}).items():
                tier, _, label = where.partition(":")   # tier names hold no ':'
                if n:
                    metric.labels(*labels, tier, label).inc(n)
        for where, n in (transfer_stats_data.get("tenant_blocks") or {}).items():
            tier, _, label = where.partition(":")
            self._tenant_held.labels(*labels, tier, label).set(n)
        est = transfer_stats_data.get("estimates")
        if est:
            for path, v in est["bandwidth"].items():
                self._bandwidth.labels(*labels, path).set(v)
            for path, v in est["overhead"].items():
                self._overhead.labels(*labels, path).set(v)
            self._prefill.labels(*labels).set(est["prefill"])
