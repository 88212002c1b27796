"""The online cost model: priors per tier kind, convergence to what transfers show, robust
to outliers, decaying when stale; fed by every planner and shown in status output."""

from __future__ import annotations

import math

import pytest

from kvstrata.kinds import cost_priors
from kvstrata.placement.costs import (ALPHA, ALPHA_WORSE, CLIP, STALE_HALF_LIFE, CostModel,
                                      Estimate)


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
    model = CostModel(cost_priors(), Clock())
    g2, g3, g4 = (model.bandwidth(p) for p in ("G2->G1", "G3->G1", "G4->G1"))
    assert g2 > g3 > g4
    assert model.overhead("G4->G1") > model.overhead("G3->G1") > model.overhead("G2->G1")
    assert model.snapshot()["prefill_samples"] == 0


def test_estimates_converge_to_what_the_transfers_show():
    model = CostModel(cost_priors(), Clock())
    feed(model, "G3->G1", gbps=0.2, overhead=0.05)
    assert model.bandwidth("G3->G1") == pytest.approx(0.2e9, rel=0.05)
    assert model.overhead("G3->G1") == pytest.approx(0.05, rel=0.05)
    nbytes = 256 << 20
    assert model.load_seconds("G3->G1", nbytes) == pytest.approx(0.05 + nbytes / 0.2e9, rel=0.05)
    for _ in range(20):
        model.observe_prefill(4096, 2.0)
    assert model.recompute_seconds(4096) == pytest.approx(2.0, rel=0.05)


def test_one_outlier_moves_a_warm_estimate_by_a_bounded_factor():
    model = CostModel(cost_priors(), Clock())
    feed(model, "G2->G1", gbps=8.0, overhead=1e-4)
    before = model.bandwidth("G2->G1")
    feed(model, "G2->G1", gbps=0.001, overhead=1e-4, n=1)        # one 8000x slower plan
    after = model.bandwidth("G2->G1")
    assert after < before and before / after <= CLIP ** ALPHA_WORSE * 1.0001
    feed(model, "G2->G1", gbps=8000.0, overhead=1e-4, n=1)       # one 1000x faster plan
    assert model.bandwidth("G2->G1") / after <= CLIP ** ALPHA * 1.0001


def test_bad_news_is_believed_sooner_than_good_news():
    model = CostModel(cost_priors(), Clock())
    feed(model, "G3->G1", gbps=2.0, overhead=1e-3)
    feed(model, "G3->G1", gbps=0.5, overhead=1e-3, n=3)            # 4x slower, three plans
    slowed = model.bandwidth("G3->G1")
    feed(model, "G3->G1", gbps=2.0, overhead=1e-3, n=3)            # back, three plans
    recovered = model.bandwidth("G3->G1")
    assert 2.0e9 / slowed > 2.5                                    # most of the drop taken
    assert recovered < 1.5e9                                       # trusted back gradually


def test_an_unmeasured_path_borrows_what_its_slow_tier_showed_elsewhere():
    model = CostModel(cost_priors(), Clock())
    assert model.bandwidth("G4->G1") == pytest.approx(100e6)          # kind prior
    feed(model, "G2->G4", gbps=0.01, overhead=0.3)                    # stores crawl
    feed(model, "G1->G2", gbps=10.0, overhead=1e-5)                   # unrelated path
    assert model.bandwidth("G4->G1") == pytest.approx(0.01e9, rel=0.05)
    assert model.overhead("G4->G1") == pytest.approx(0.3, rel=0.05)
    assert model.bandwidth("G3->G1") == pytest.approx(1.5e9)          # G3 measured nowhere
    # its own samples win: 100x better than its borrowed prior, and good news is clipped
    # to CLIP x the estimate from the first sample on, so it takes ~25 plans, not ~5
    feed(model, "G4->G1", gbps=1.0, overhead=0.01, n=30)
    assert model.bandwidth("G4->G1") == pytest.approx(1.0e9, rel=0.05)


def test_a_load_waits_for_the_bytes_in_flight_on_its_path():
    model = CostModel(cost_priors(), Clock())
    feed(model, "G3->G1", gbps=1.0, overhead=1e-3)
    block = 1 << 20
    alone = model.load_seconds("G3->G1", 100 * block, block)
    backlog = {"G3->G1": 400}
    model.attach_backlog(lambda path: backlog.get(path, 0))
    assert model.load_seconds("G3->G1", 100 * block, block) == pytest.approx(
        alone + 400 * block / 1e9, rel=0.05)
    assert model.load_seconds("G2->G1", block, block) < 0.01          # other paths unaffected
    assert model.snapshot()["paths"]["G3->G1"]["blocks_in_flight"] == 400
    tiers = ["G3"] * 8
    for _ in range(10):
        model.observe_prefill(2048, 1.0)
    backlog["G3->G1"] = 8
    assert model.worth_loading(tiers, "G1", block, 32) == 8           # 16 ms vs 125 ms
    backlog["G3->G1"] = 2048                                          # 2 GiB queued: 2 s
    assert model.worth_loading(tiers, "G1", block, 32) == 0           # recompute (0.125 s)


def test_a_path_that_got_slow_is_learned_and_a_stale_one_returns_to_its_prior():
    clock = Clock()
    model = CostModel(cost_priors(), clock)
    feed(model, "G4->G1", gbps=1.0, overhead=0.01)
    fast = model.bandwidth("G4->G1")
    feed(model, "G4->G1", gbps=0.01, overhead=0.5, n=40)            # throttled now
    assert model.bandwidth("G4->G1") < fast / 20
    clock.t += 20 * STALE_HALF_LIFE                                  # nothing for hours
    assert model.bandwidth("G4->G1") == pytest.approx(100e6, rel=0.01)


def test_bad_samples_are_ignored():
    estimate = Estimate(5.0)
    for value in (0.0, -1.0, math.nan, math.inf, 10**400, -10**400):
        estimate.add(value, 0.0)
    assert estimate.samples == 0 and estimate.value(0.0) == 5.0


def test_a_sample_past_the_floats_is_ignored_not_raised():
    """A hostile result claiming more than ~1e308 bytes (or prompt tokens) moved: ignored as a
    NaN or infinite sample is, never an OverflowError out of the planner's completion."""
    model = CostModel(cost_priors(), Clock())
    model.transfer_done("G3->G1", 1, 10**400, 1.0, 2.0, ())
    model.transfer_done("G3->G1", 1, 10**400, 1e-300, 2.0, ())
    model.observe_prefill(10**400, 1.0)
    snap = model.snapshot()
    assert snap["paths"]["G3->G1"]["samples"] == 0 and snap["prefill_samples"] == 0
    assert model.bandwidth("G3->G1") == pytest.approx(1.5e9)


MB2 = 2 << 20


def test_a_first_sample_is_clipped_like_any_other():
    """The reviewer's repro_cost_cold_outlier.py: one 2 MiB-in-1-us first sample on a path
    measured nowhere set its bandwidth to 1.7e10 B/s (11x the disk's prior: the first
    WARM_SAMPLES samples were not clipped at all) and the model loaded 32 blocks from G3
    (46 ms) that recomputing does in 10 ms. Clipped to CLIP x the prior, and blended with it
    (one sample of WARM_SAMPLES), it moves the estimate by CLIP ** (1/3)."""
    model = CostModel(cost_priors(), Clock())
    model.assume_prefill(50_000)
    prior = model.bandwidth("G3->G1")
    assert model.worth_loading(["G3"] * 32, "G1", MB2, 16) == 0
    model.transfer_done("G3->G1", 1, MB2, 1e-6, 1e-6 + 1e-3, ())
    assert model.bandwidth("G3->G1") == pytest.approx(prior * CLIP ** (1 / 3))
    assert model.worth_loading(["G3"] * 32, "G1", MB2, 16) == 0
    # the next young samples are clipped to CLIP x the blended estimate too
    for _ in range(2):
        before = model.bandwidth("G3->G1")
        model.transfer_done("G3->G1", 1, MB2, 1e-6, 1e-6 + 1e-3, ())
        assert model.bandwidth("G3->G1") <= before * CLIP * 1.0001
    # real samples after one outlier: not loading, and soon near the truth
    model = CostModel(cost_priors(), Clock())
    model.assume_prefill(50_000)
    model.transfer_done("G3->G1", 1, MB2, 1e-6, 1e-6 + 1e-3, ())
    for _ in range(3):
        model.transfer_done("G3->G1", 1, MB2, MB2 / 1.5e9, MB2 / 1.5e9 + 1e-3, ())
        assert model.worth_loading(["G3"] * 32, "G1", MB2, 16) == 0
    assert model.bandwidth("G3->G1") < 1.5 * 1.5e9


def test_a_young_estimate_believes_bad_news_at_once():
    """Pessimistic from the first sample: a path far slower than its prior (a bucket behind a
    slow link, tiny blocks: 10,000x) is believed within its first plans, unclipped; only
    good news is clipped while young. The prefill rate (no worse side) is bounded by its
    prior, CLIP ** WARM_SAMPLES either way."""
    model = CostModel(cost_priors(), Clock())
    prior = model.bandwidth("G4->G1")
    for _ in range(3):
        model.transfer_done("G4->G1", 1, 4096, 4096 / (prior / 1e4), 4096 / (prior / 1e4), ())
    assert model.bandwidth("G4->G1") == pytest.approx(prior / 1e4)
    model.observe_prefill(10**9, 1.0)
    assert math.exp(model.prefill.log_mean) == pytest.approx(2_000 * CLIP ** 3)
    assert model.prefill.value(1000.0) == pytest.approx(2_000 * CLIP)


def test_a_run_of_good_news_moves_an_estimate_by_at_most_clip_a_sample():
    """Young or warm, an estimate fed samples 10,000 times better than it (or, without a
    worse side, off either way) moves by CLIP a sample at most, and still gets there."""
    for value, higher_is_better in ((5e4, True), (5e-4, False), (5e4, None), (5e-4, None)):
        estimate = Estimate(5.0, higher_is_better=higher_is_better)
        for _ in range(60):
            before = estimate.value(0.0)
            estimate.add(value, 0.0)
            assert 1 / CLIP <= estimate.value(0.0) / before <= CLIP * 1.0001
        assert estimate.value(0.0) == pytest.approx(value, rel=0.05)


def test_blocks_already_in_the_top_tier_cost_nothing_and_make_no_path():
    """The reviewer's repro_cost_resident.py, on the model: a prefix already in G1 was charged
    a made-up G1->G1 load (the device prior's 50 us a plan) and refused with a fast engine;
    and the model grew a "G1->G1" path."""
    model = CostModel(cost_priors(), Clock())
    model.assume_prefill(2e6)                    # 16 tokens: 8 us
    assert model.worth_loading(["G1"] * 4, "G1", MB2, 16) == 4
    assert model.saving(["G1"] * 4, "G1", MB2, 16, 4) == pytest.approx(4 * 16 / 2e6)
    assert model.snapshot()["paths"] == {}
    # resident blocks ahead of a run in a slow tier: the cut after them is the best one
    assert model.worth_loading(["G1"] * 4 + ["G3"] * 4, "G1", MB2, 16) == 4
    # the tier of the lower runs still decides as before
    model.assume_prefill(1_000)
    assert model.worth_loading(["G1"] * 2 + ["G2"] * 4, "G1", MB2, 16) == 6
    assert sorted(model.snapshot()["paths"]) == ["G2->G1", "G3->G1"]   # no G1->G1


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
    model = CostModel(cost_priors(), Clock())
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


def test_the_planner_counts_blocks_in_flight_per_path_until_their_results_come_back():
    from test_planner import chain, compute, failed, planner
    from kvstrata.protocol import TransferResult

    p = planner(g1=8, g2=8, g3=32, costs=CostModel(cost_priors()))
    compute(p, chain(6))
    plans = p.take_plans()
    assert plans
    in_flight = {pl.path: 0 for pl in plans}
    for pl in plans:
        in_flight[pl.path] += len(pl)
    assert {path: p.costs.blocks_in_flight(path) for path in in_flight} == in_flight
    first, rest = plans[0], plans[1:]
    p.complete([failed(first, [0])])                       # a failed block still ends the job
    assert p.costs.blocks_in_flight(first.path) == in_flight[first.path] - len(first)
    p.complete([TransferResult(pl, (True,) * len(pl), (None,) * len(pl), 0, 0.0, ())
                for pl in rest])
    while (more := p.take_plans()):
        p.complete([TransferResult(pl, (True,) * len(pl), (None,) * len(pl), 0, 0.0, ())
                    for pl in more])
    assert all(p.costs.blocks_in_flight(path) == 0 for path in ("G1->G2", "G2->G3"))


def test_a_cost_aware_manager_onboard_loads_only_what_beats_recomputing():
    from test_manager import chain, evict_g1, hashes_of, make_config, payloads, put
    from kvstrata.manager import KvBlockManager

    records = chain(6)
    with KvBlockManager(make_config(g1=8, g2=8, g3=32)) as mgr:
        put(mgr, records, payloads(mgr, records))
        evict_g1(mgr)
        assert set(mgr.locate(hashes_of(records)).result(30)) <= {"G2", "G3"}
        mgr.assume_prefill(1e12).result(30)                 # recomputing is instant
        with mgr.onboard(hashes_of(records), cost_aware=True).result(30) as nothing:
            assert len(nothing) == 0
        mgr.assume_prefill(1.0).result(30)                  # recomputing takes forever
        with mgr.onboard(hashes_of(records), cost_aware=True).result(30) as everything:
            assert len(everything) == len(records)


def test_a_cost_aware_onboard_shows_the_whole_request_to_the_filter():
    """The filter that learns from requests must see the blocks to be computed, not only
    the part the cost model loads (here: nothing, so it would see nothing)."""
    from test_manager import chain, hashes_of, make_config
    from kvstrata.logical.reuse_prediction import PredictedReuseAdmission
    from kvstrata.manager import KvBlockManager

    records = chain(5, start=100)
    with KvBlockManager(make_config(g1=8, g2=8, g3=32)) as mgr:
        bottom = mgr.planner._state.admission["G3"]
        assert isinstance(bottom, PredictedReuseAdmission)       # the default filter
        mgr.assume_prefill(1e12).result(30)
        with mgr.onboard(hashes_of(records), cost_aware=True).result(30) as loaded:
            assert len(loaded) == 0
        assert set(hashes_of(records)) <= set(bottom._kinds)
