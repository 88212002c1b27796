"""The online cost model: priors per tier kind, convergence to what transfers show, robust
to outliers, decaying when stale; fed by every planner and shown in status output."""

from __future__ import annotations

import math

import pytest

from kvstrata.placement.costs import CLIP, STALE_HALF_LIFE, CostModel, Estimate


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def feed(model, path, gbps, overhead, n=20, nbytes=64 << 20):
    busy = nbytes / (gbps * 1e9)
    for _ in range(n):
        model.transfer_done(path, 32, nbytes, busy, busy + overhead, ())


def test_priors_order_the_tiers_before_anything_is_measured():
    model = CostModel(Clock())
    g2, g3, g4 = (model.bandwidth(p) for p in ("G2->G1", "G3->G1", "G4->G1"))
    assert g2 > g3 > g4
    assert model.overhead("G4->G1") > model.overhead("G3->G1") > model.overhead("G2->G1")
    assert model.snapshot()["prefill_samples"] == 0


def test_estimates_converge_to_what_the_transfers_show():
    model = CostModel(Clock())
    feed(model, "G3->G1", gbps=0.2, overhead=0.05)
    assert model.bandwidth("G3->G1") == pytest.approx(0.2e9, rel=0.05)
    assert model.overhead("G3->G1") == pytest.approx(0.05, rel=0.05)
    nbytes = 256 << 20
    assert model.load_seconds("G3->G1", nbytes) == pytest.approx(0.05 + nbytes / 0.2e9, rel=0.05)
    for _ in range(20):
        model.observe_prefill(4096, 2.0)
    assert model.recompute_seconds(4096) == pytest.approx(2.0, rel=0.05)


def test_one_outlier_moves_a_warm_estimate_by_a_bounded_factor():
    model = CostModel(Clock())
    feed(model, "G2->G1", gbps=8.0, overhead=1e-4)
    before = model.bandwidth("G2->G1")
    feed(model, "G2->G1", gbps=0.001, overhead=1e-4, n=1)        # one 8000x slower plan
    after = model.bandwidth("G2->G1")
    assert after < before and before / after <= CLIP ** 0.2 * 1.0001


def test_a_path_that_got_slow_is_learned_and_a_stale_one_returns_to_its_prior():
    clock = Clock()
    model = CostModel(clock)
    feed(model, "G4->G1", gbps=1.0, overhead=0.01)
    fast = model.bandwidth("G4->G1")
    feed(model, "G4->G1", gbps=0.01, overhead=0.5, n=40)            # throttled now
    assert model.bandwidth("G4->G1") < fast / 20
    clock.t += 20 * STALE_HALF_LIFE                                  # nothing for hours
    assert model.bandwidth("G4->G1") == pytest.approx(100e6, rel=0.01)


def test_bad_samples_are_ignored():
    estimate = Estimate(5.0)
    for value in (0.0, -1.0, math.nan, math.inf):
        estimate.add(value, 0.0)
    assert estimate.samples == 0 and estimate.value(0.0) == 5.0


def test_every_manager_learns_its_paths_and_shows_them():
    from test_manager import chain, hashes_of, make_config, payloads, put
    from kvstrata.manager import KvBlockManager

    records = chain(8)
    with KvBlockManager(make_config(g1=8, g2=8, g3=32)) as mgr:
        data = payloads(mgr, records)
        put(mgr, records[:4], data)
        put(mgr, records[4:], data)
        mgr.wait_idle(30)
        costs = mgr.status()["costs"]["paths"]
        assert costs["G1->G2"]["samples"] >= 1 and costs["G2->G3"]["samples"] >= 1
        assert all(c["bandwidth_bytes_per_s"] > 0 for c in costs.values())
        assert mgr.locate(hashes_of(records)).result(30)


def test_worth_loading_cuts_where_the_slow_tier_starts():
    model = CostModel(Clock())
    feed(model, "G2->G1", gbps=10.0, overhead=1e-5)
    for _ in range(10):
        model.observe_prefill(4096, 1.0)                      # 4,096 tokens/s
    block = 128 << 10
    tiers = ["G2", "G2", "G3", "G3", "G4"]
    feed(model, "G3->G1", gbps=1.0, overhead=1e-4)
    feed(model, "G4->G1", gbps=1.0, overhead=1e-3)
    assert model.worth_loading(tiers, "G1", block, 16) == 5          # all fast: load all
    feed(model, "G4->G1", gbps=0.0001, overhead=2.0, n=40)           # G4 crawls
    assert model.worth_loading(tiers, "G1", block, 16) == 4          # stop before G4
    feed(model, "G3->G1", gbps=0.0001, overhead=2.0, n=40)           # and the disk too
    assert model.worth_loading(tiers, "G1", block, 16) == 2          # the G2 part only
    feed(model, "G2->G1", gbps=0.0001, overhead=2.0, n=40)
    assert model.worth_loading(tiers, "G1", block, 16) == 0          # recompute it all
    assert model.worth_loading([], "G1", block, 16) == 0
