"""Prometheus metrics of the block manager: names, label values, per-manager registries."""

from __future__ import annotations

import urllib.request

from prometheus_client import REGISTRY, CollectorRegistry

from kvstrata.manager import KvBlockManager
from kvstrata.metrics import ManagerMetrics

from test_manager import chain, evict_g1, hashes_of, make_config, payloads, put


def test_counters_follow_offload_and_onboard(tmp_path):
    with KvBlockManager(make_config(), disk_dir=tmp_path) as mgr:
        m = mgr.metrics.value
        block_bytes = mgr.storage("G1").config.block_bytes
        assert m("kvstrata_tier_capacity_blocks", tier="G2") == 8
        assert m("kvstrata_tier_capacity_bytes", tier="G3") == mgr.storage("G3").status().bytes
        records = chain(4)
        put(mgr, records, payloads(mgr, records))
        mgr.wait_idle(10)
        for path in ("G1->G2", "G2->G3"):
            assert m("kvstrata_offload_blocks_total", path=path) == 4
            assert m("kvstrata_offload_bytes_total", path=path) == 4 * block_bytes
            assert m("kvstrata_transfer_seconds_count", path=path) == 1
        evict_g1(mgr)
        with mgr.onboard(hashes_of(records) + [12345]).result():
            pass
        assert m("kvstrata_onboard_blocks_total", path="G2->G1") == 4
        assert m("kvstrata_onboard_bytes_total", path="G2->G1") == 4 * block_bytes
        assert m("kvstrata_lookup_blocks_total") == 5
        assert m("kvstrata_hit_blocks_total", tier="G2") == 4
        with mgr.onboard(hashes_of(records)).result():
            pass
        assert m("kvstrata_hit_blocks_total", tier="G1") == 4
        assert m("kvstrata_tier_evictions_total", tier="G1") == 4
        mgr.status()                      # the owner has published the latest pool gauges
        assert m("kvstrata_tier_blocks", tier="G1", state="inactive") == 4
        assert m("kvstrata_tier_blocks", tier="G1", state="active") == 0
        assert m("kvstrata_transfers_in_flight") == 0
        assert m("kvstrata_checksum_failures_total", tier="G3") == 0


def test_each_manager_has_its_own_registry():
    with KvBlockManager(make_config(g3=0)) as a, KvBlockManager(make_config(g3=0)) as b:
        assert a.metrics.registry is not b.metrics.registry
        records = chain(2)
        put(a, records, payloads(a, records))
        a.wait_idle(10)
        assert a.metrics.value("kvstrata_offload_blocks_total", path="G1->G2") == 2
        assert b.metrics.value("kvstrata_offload_blocks_total", path="G1->G2") == 0
    assert REGISTRY.get_sample_value("kvstrata_offload_blocks_total", {"path": "G1->G2"}) is None


def test_shared_registry_can_be_given():
    registry = CollectorRegistry()
    with KvBlockManager(make_config(g3=0), metrics_registry=registry) as mgr:
        assert mgr.metrics.registry is registry
        assert registry.get_sample_value("kvstrata_tier_capacity_blocks", {"tier": "G1"}) == 8


def test_http_endpoint_serves_metrics_and_stops_on_close():
    mgr = KvBlockManager(make_config(g3=0), metrics_port=0)
    try:
        assert mgr.metrics_port
        url = f"http://127.0.0.1:{mgr.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'kvstrata_tier_capacity_blocks{tier="G1"} 8.0' in body
        assert "kvstrata_transfers_in_flight 0.0" in body
        records = chain(2)
        put(mgr, records, payloads(mgr, records))
        mgr.wait_idle(10)
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'kvstrata_offload_blocks_total{path="G1->G2"} 2.0' in body
        assert 'kvstrata_transfer_seconds_count{path="G1->G2"} 1.0' in body
    finally:
        mgr.close()
    try:
        urllib.request.urlopen(url, timeout=1)
        raise AssertionError("endpoint still serving after close")
    except OSError:
        pass


def test_endpoint_is_off_by_default():
    metrics = ManagerMetrics()
    assert metrics._server is None
    metrics.close()


def test_close_unregisters_so_a_shared_registry_can_be_reused():
    registry = CollectorRegistry()
    with KvBlockManager(make_config(g3=0), metrics_registry=registry) as first:
        records = chain(2)
        put(first, records, payloads(first, records))
        first.wait_idle(10)
    assert registry.get_sample_value("kvstrata_tier_capacity_blocks", {"tier": "G1"}) is None
    assert first.metrics.value("kvstrata_offload_blocks_total", path="G1->G2") == 2
    with KvBlockManager(make_config(g1=4, g3=0), metrics_registry=registry):
        assert registry.get_sample_value("kvstrata_tier_capacity_blocks", {"tier": "G1"}) == 4


def test_a_clash_in_a_shared_registry_leaves_nothing_registered():
    registry = CollectorRegistry()
    with KvBlockManager(make_config(g3=0), metrics_registry=registry):
        names = set(registry._names_to_collectors)
        try:
            ManagerMetrics(registry)
            raise AssertionError("a second set of the same collectors was accepted")
        except ValueError:
            pass
        assert set(registry._names_to_collectors) == names
