"""The connector's counters as vLLM stats: increases per step, aggregation across reports,
the flat form vLLM logs, and the Prometheus counters they feed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvstrata.connectors.vllm.stats import KvStrataPromMetrics, KvStrataStats, delta  # noqa: E402


def snapshot(g2=0, g3=0, failed=0, offered=0, no_slot=0):
    return {"tokens_matched": {"G2": g2 * 32}, "blocks_loaded": {"G2": g2, "G3": g3},
            "blocks_load_failed": failed, "blocks_offered": offered, "requests_held": 0,
            "blocks_not_stored": {"G2:no_slot": no_slot} if no_slot else {}}


def test_delta_aggregate_reduce():
    a = KvStrataStats(data=delta(snapshot(g2=5, offered=9), snapshot(g2=2, offered=4)))
    assert a.data["blocks_loaded"] == {"G2": 3} and a.data["blocks_offered"] == 5
    b = KvStrataStats(data=delta(snapshot(g2=5, g3=4, no_slot=2), snapshot(g2=5)))
    a.aggregate(b)
    flat = a.reduce()
    assert flat["blocks_loaded_G2"] == 3 and flat["blocks_loaded_G3"] == 4
    assert flat["blocks_not_stored_G2:no_slot"] == 2 and flat["blocks_offered"] == 5
    assert not a.is_empty()
    assert KvStrataStats().is_empty()
    assert KvStrataStats(data=delta(snapshot(g2=1), snapshot(g2=1))).is_empty()


def prom_metrics() -> tuple[KvStrataPromMetrics, CollectorRegistry]:
    """kvstrata's Prometheus metrics in a registry of their own."""
    registry = CollectorRegistry()

    def bound(cls):
        return lambda **kw: cls(registry=registry, **kw)

    class Config:
        kv_transfer_config = None

    return KvStrataPromMetrics(Config(), {Counter: bound(Counter), Gauge: bound(Gauge),
                                          Histogram: bound(Histogram)},
                               ["engine"], {0: ["0"]}), registry


def test_prometheus_counters_follow_the_stats():
    prom, registry = prom_metrics()
    prom.observe(delta(snapshot(g2=3, g3=1, failed=2, no_slot=4), snapshot()), 0)
    prom.observe(delta(snapshot(g2=5, g3=1, failed=2, no_slot=4), snapshot(g2=3, g3=1,
                                                                         failed=2, no_slot=4)))
    value = registry.get_sample_value
    assert value("vllm:kvstrata_blocks_loaded_total", {"engine": "0", "tier": "G2"}) == 5
    assert value("vllm:kvstrata_blocks_loaded_total", {"engine": "0", "tier": "G3"}) == 1
    assert value("vllm:kvstrata_blocks_load_failed_total", {"engine": "0"}) == 2
    assert value("vllm:kvstrata_blocks_not_stored_total",
                 {"engine": "0", "tier": "G2", "reason": "no_slot"}) == 4


def test_cost_estimates_become_gauges_sent_when_they_move():
    from kvstrata.connectors.vllm.stats import estimates, moved
    from kvstrata.kinds import cost_priors
    from kvstrata.placement.costs import CostModel

    costs = CostModel(cost_priors())
    costs.transfer_done("G3->G1", 8, 8 << 20, 0.01, 0.02, ())
    costs.observe_prefill(4096, 2.0)
    est = estimates(costs.snapshot())
    assert est["bandwidth"]["G3->G1"] == pytest.approx(costs.bandwidth("G3->G1"), rel=1e-3)
    assert moved(est, None) and not moved(est, est)
    costs.transfer_done("G3->G1", 8, 8 << 20, 1.0, 1.5, ())       # a slow plan: it moved
    assert moved(estimates(costs.snapshot()), est)

    stats = KvStrataStats(data=delta(snapshot(), snapshot()))
    assert stats.is_empty()
    stats.data["estimates"] = est
    assert not stats.is_empty()
    later = KvStrataStats(data={"estimates": estimates(costs.snapshot())})
    stats.aggregate(later)                                        # the later report wins
    assert stats.data["estimates"]["bandwidth"]["G3->G1"] < est["bandwidth"]["G3->G1"]
    assert stats.reduce()["prefill_tokens_per_s"] == est["prefill"]

    prom, registry = prom_metrics()
    prom.observe(stats.data, 0)
    value = registry.get_sample_value
    assert value("vllm:kvstrata_path_bandwidth_bytes_per_second",
                 {"engine": "0", "path": "G3->G1"}) == stats.data["estimates"]["bandwidth"]["G3->G1"]
    assert value("vllm:kvstrata_prefill_tokens_per_second", {"engine": "0"}) == est["prefill"]


def test_per_tenant_counters_and_held_blocks_reach_prometheus():
    prom, registry = prom_metrics()
    before = {"tenant_tokens_matched": {}, "tenant_blocks_evicted": {}}
    now = {"tenant_tokens_matched": {"gold": 64, "*": 32},
           "tenant_blocks_evicted": {"G2:gold": 3, "G3:lora:sql": 1},
           "tenant_blocks_refused": {"G2:*": 2}}
    stats = KvStrataStats(data=delta(now, before))
    assert not stats.is_empty()
    held = KvStrataStats(data={"tenant_blocks": {"G2:gold": 12, "G2:*": 5}})
    assert not held.is_empty()
    stats.aggregate(held)
    prom.observe(stats.data, 0)
    prom.observe(KvStrataStats(data={"tenant_blocks": {"G2:gold": 0, "G2:*": 7}}).data, 0)
    value = registry.get_sample_value
    assert value("vllm:kvstrata_tenant_tokens_matched_total",
                 {"engine": "0", "tenant": "gold"}) == 64
    assert value("vllm:kvstrata_tenant_blocks_evicted_total",
                 {"engine": "0", "tier": "G3", "tenant": "lora:sql"}) == 1
    assert value("vllm:kvstrata_tenant_blocks_refused_total",
                 {"engine": "0", "tier": "G2", "tenant": "*"}) == 2
    assert value("vllm:kvstrata_tenant_blocks", {"engine": "0", "tier": "G2",
                                                 "tenant": "gold"}) == 0
    assert value("vllm:kvstrata_tenant_blocks", {"engine": "0", "tier": "G2",
                                                 "tenant": "*"}) == 7
