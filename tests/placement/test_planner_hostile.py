"""Hostile tests of the placement Planner through its public API: malformed and forged results,
partial failures, out-of-order completion, engine-owned G1, deferral, and seeded random
stress. Every refused call must change nothing; every run must settle to a consistent state."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kvstrata.config import KvConfig, TierConfig
from kvstrata.logical.block import BlockState
from kvstrata.placement import PlacementError, Planner, drive
from kvstrata.protocol import Endpoint, TransferPlan, TransferResult
from kvstrata.protocol.results import BlockFailure, FailureKind
from kvstrata.tokens import hash_blocks
from kvstrata.types import BlockRecord

BS = 4
DROPS_ON_READ = {FailureKind.IO_ERROR, FailureKind.CHECKSUM_MISMATCH,
                 FailureKind.HASH_MISMATCH, FailureKind.NOT_WRITTEN, FailureKind.NOT_FOUND}


def chain(n: int, start: int = 0) -> list[BlockRecord]:
    local, seqs = hash_blocks(np.arange(start, start + n * BS, dtype="<u4"), BS)
    return [BlockRecord(s, l, p, BS) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]


def hs(records) -> list[int]:
    return [r.sequence_hash for r in records]


def make(g1=8, g2=8, g3=32, eviction="lru", admission="always", **kw) -> Planner:
    """A planner over G1/G2/G3. Every block is admitted unless a test names a filter: these
    tests are about copies and failures (a filter's own rules are tested below and in
    tests/logical/test_reuse_prediction.py)."""
    tiers = {t: TierConfig(blocks=n) for t, n in (("G1", g1), ("G2", g2), ("G3", g3))}
    return Planner(KvConfig(block_size=BS, eviction=eviction, admission=admission,
                            tiers=tiers), **kw)


def compute(p: Planner, records) -> None:
    g1 = p.pools["G1"]
    blocks = g1.allocate(len(records))
    blocks.apply_token_blocks(records)
    g1.release(p.register(blocks))


def in_lower_tiers(p: Planner, records) -> None:
    """Compute ``records``, let them cascade to G2 and G3, then evict them from G1."""
    compute(p, records)
    drive(p)
    p.pools["G1"].reset_blocks(list(reversed(hs(records))))


def pool_hashes(pool) -> set[int]:
    blocks = (pool.block(i) for i in range(pool.capacity))
    return {b.sequence_hash for b in blocks if b.state is BlockState.REGISTERED}


def snapshot(p: Planner):
    return ({t: dataclasses.astuple(pool.status()) for t, pool in p.pools.items()},
            {t: pool_hashes(pool) for t, pool in p.pools.items()},
            {t: p.registry.hashes_in(t) for t in p.tiers}, p.pending,
            p.engine_blocks_in_use(), {t: p.quarantined(t) for t in p.tiers},
            {k: (v.plans, v.blocks, v.failed_blocks) for k, v in p.stats.paths.items()},
            dict(p.stats.skipped_blocks), dict(p.stats.failed_kinds))


def check(p: Planner) -> None:
    for tier, pool in p.pools.items():
        pool.check_invariants()
        assert p.registry.hashes_in(tier) == pool_hashes(pool), tier


def result(plan: TransferPlan, failures=None, explain: bool = True) -> TransferResult:
    """``failures``: {position: FailureKind}; ``explain=False`` leaves out the BlockFailures."""
    failures = failures or {}
    n = len(plan)
    ids = plan.dst_block_ids or (-1,) * n
    listed = tuple(BlockFailure(i, ids[i], k, "injected") for i, k in sorted(failures.items()))
    return TransferResult(plan, tuple(i not in failures for i in range(n)), (None,) * n, 0, 0.0,
                          listed if explain else ())


# -- 1. hostile results ---------------------------------------------------------------------

def _scenario(mode: str):
    """A planner with exactly one plan outstanding, and a check of the state it must reach
    once that plan (and what follows) completes normally."""
    records = chain(3)
    if mode == "external":
        p = make(engine_owns_top=True)
        p.prepare_offload("G1", records, [4, 5, 6])
    else:
        p = make()
        if mode == "onboard":
            in_lower_tiers(p, records)
            p.prepare_onboard(hs(records))
        else:
            compute(p, records)
    (plan,) = p.take_plans()

    def finish():
        p.complete([TransferResult.success(plan)])
        drive(p)
        assert p.idle and p.engine_blocks_in_use() == frozenset()
        assert set(hs(records)) <= pool_hashes(p.pools["G3"])
        if mode == "onboard":
            (res,) = p.take_finished()
            assert res.sequence_hashes == hs(records) and res.sources == ("G2",) * 3
            res.release()
            assert p.pools["G1"].status().active == 0
        check(p)
    return p, plan, finish


def _ok(plan, ok, failures=()):
    return TransferResult(plan, ok, (None,) * len(plan), 0, 0.0,
                          failures if failures is None else tuple(failures))


def _fail(pos, kind=FailureKind.IO_ERROR):
    return BlockFailure(pos, 0, kind, "hostile")


def _as(pl, **changes):
    return [TransferResult.success(dataclasses.replace(pl, **changes))]


HOSTILE = {
    "unknown_job": lambda pl, n: _as(pl, job_id=pl.job_id + 1000),
    "twice_in_one_call": lambda pl, n: [TransferResult.success(pl)] * 2,
    "different_dst_ids": lambda pl, n: _as(pl, dst_block_ids=pl.dst_block_ids[::-1]),
    "different_src_ids": lambda pl, n: _as(pl, src_block_ids=[i + 99 for i in pl.src_block_ids]),
    "different_hashes": lambda pl, n: _as(pl, sequence_hashes=pl.sequence_hashes[::-1]),
    "different_worker": lambda pl, n: _as(pl, target=Endpoint(pl.target.tier, 1)),
    "different_path": lambda pl, n: _as(pl, target=Endpoint("G3")),
    "short_ok": lambda pl, n: [_ok(pl, (True,) * (n - 1))],
    "long_ok": lambda pl, n: [_ok(pl, (True,) * (n + 1))],
    "empty_ok": lambda pl, n: [_ok(pl, ())],
    "ok_list": lambda pl, n: [_ok(pl, [True] * n)],
    "ok_ints": lambda pl, n: [_ok(pl, (1,) * n)],
    "ok_mixed_int": lambda pl, n: [_ok(pl, (True,) * (n - 1) + (0,))],
    "ok_numpy_bools": lambda pl, n: [_ok(pl, tuple(np.ones(n, dtype=bool)))],
    "ok_none": lambda pl, n: [_ok(pl, None)],
    "failure_on_ok_position": lambda pl, n: [_ok(pl, (True,) * n, [_fail(0)])],
    "failure_out_of_range": lambda pl, n: [_ok(pl, (False,) * n, [_fail(n)])],
    "failure_negative": lambda pl, n: [_ok(pl, (False,) * n, [_fail(-1)])],
    "failure_position_none": lambda pl, n: [_ok(pl, (False,) * n, [_fail(None)])],
    "failure_not_a_blockfailure": lambda pl, n: [_ok(pl, (False,) * n, ["io_error"])],
    "plan_instead_of_result": lambda pl, n: [pl],
    "dict_instead_of_result": lambda pl, n: [TransferResult.success(pl).to_dict()],
    "none": lambda pl, n: [None],
    "good_then_junk": lambda pl, n: [TransferResult.success(pl), "junk"],
    "unknown_then_good": lambda pl, n: _as(pl, job_id=pl.job_id + 7) + _as(pl),
}
HOSTILE_BUGS = {   # case -> (results, the bug this case found: fixed, kept as a regression)
    "failure_kind_not_a_failurekind": (
        lambda pl, n: [_ok(pl, (False,) + (True,) * (n - 1), [_fail(0, "bogus")])],
        "checks.py check_results does not check BlockFailure.kind: accepted, then applying "
        "it raises AttributeError (failure.kind.value) and the job is abandoned, good blocks "
        "thrown away"),
    "failures_none": (lambda pl, n: [_ok(pl, (True,) * n, None)],
                      "checks.py check_results: TypeError, not PlacementError"),
    "duplicate_failure_positions": (
        lambda pl, n: [_ok(pl, (False,) + (True,) * (n - 1), [_fail(0)] * 3)],
        "checks.py check_results accepts 3 failures for one position; stats count 3"),
}
CASES = [pytest.param(k, id=k) for k in (*HOSTILE, *HOSTILE_BUGS)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["offload", "onboard", "external"])
def test_hostile_result_is_refused_and_changes_nothing(mode, case):
    p, plan, finish = _scenario(mode)
    build = HOSTILE[case] if case in HOSTILE else HOSTILE_BUGS[case][0]
    before = snapshot(p)
    with pytest.raises(PlacementError):
        p.complete(build(plan, len(plan)))
    assert snapshot(p) == before
    assert p.take_plans() == [] and p.take_finished() == []
    finish()                                   # the genuine result still applies normally


def test_a_result_applies_once_across_calls():
    p, plan, _ = _scenario("offload")
    p.complete([TransferResult.success(plan)])
    before = snapshot(p)
    with pytest.raises(PlacementError):
        p.complete([TransferResult.success(plan)])
    with pytest.raises(PlacementError):
        p.complete([result(plan, {0: FailureKind.IO_ERROR})])
    assert snapshot(p) == before
    drive(p)
    assert p.idle and p.stats.paths["G1->G2"].plans == 1
    check(p)


def test_result_for_a_plan_not_yet_handed_out_is_refused_or_never_handed_out():
    p = make(g2=8)
    a = chain(3)
    compute(p, a)
    # The worker forges the plan the planner is about to hand out (plans are deterministic).
    forged = TransferPlan.for_path("G1->G2", [0, 1, 2], [0, 1, 2], hs(a), job_id=1)
    try:
        p.complete([TransferResult.failed(forged, FailureKind.DISK_FULL, "forged")])
    except PlacementError:
        pass
    compute(p, chain(3, start=100))            # reuses the G2 slots the failure freed
    handed = p.take_plans()
    targets = [i for q in handed for i in q.dst_block_ids]
    assert len(targets) == len(set(targets))            # no two copies into one G2 slot
    assert p.pending == len(handed)                     # every plan handed out is awaited


# -- 2. partial failures ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(FailureKind), ids=lambda k: k.value)
@pytest.mark.parametrize("explain", [True, False], ids=["explained", "unexplained"])
def test_offload_partial_failure(kind, explain):
    p = make()
    h = hs(records := chain(4))
    compute(p, records)
    (plan,) = p.take_plans()
    p.complete([result(plan, {1: kind, 3: kind}, explain=explain)])
    assert p.pools["G2"].status().active == 2          # only the G2->G3 copy's sources
    drive(p)
    assert pool_hashes(p.pools["G2"]) == pool_hashes(p.pools["G3"]) == {h[0], h[2]}
    g2 = p.pools["G2"].status()
    assert (g2.active, g2.reset) == (0, g2.capacity - 2) and p.idle
    dropped = explain and kind.bad_source               # bad bytes at the source: dropped
    assert [x in p.pools["G1"] for x in h] == [True, not dropped, True, not dropped]
    counted = kind.value if explain else "internal"
    assert p.stats.failed_kinds["G1->G2", counted] == 2
    assert p.stats.paths["G1->G2"].failed_blocks == 2 and p.stats.moved()["G1->G2"] == 2
    check(p)


@pytest.mark.parametrize("keeps", [True, False])
def test_a_filter_that_keeps_prefixes_takes_no_block_whose_parent_it_refused(keeps):
    """A filter refuses block 1 of a chain offered to G3: one that keeps prefixes whole
    loses blocks 2 and 3 with it (alone they could never hit there); one that does not keeps
    them, as Dynamo's second-offer does."""
    from kvstrata.logical.admission import AdmissionPolicy

    p = make()
    h = hs(records := chain(4))

    class RefusesOne(AdmissionPolicy):
        keeps_prefixes = keeps

        def admit(self, sequence_hash):
            return sequence_hash != h[1]
    p._state.admission["G3"] = RefusesOne()
    compute(p, records)
    drive(p)
    assert pool_hashes(p.pools["G2"]) == set(h)
    assert pool_hashes(p.pools["G3"]) == ({h[0]} if keeps else {h[0], h[2], h[3]})
    assert p.stats.skipped_for("admission")["G3"] == (3 if keeps else 1)
    check(p)


def test_a_block_whose_parent_was_never_offered_is_not_refused_for_it():
    """Block 1 failed to reach G2, so blocks 2 and 3 reach G3 without it: not a refusal of
    the filter (an engine's sliding-window group stores such blocks too), so the default
    filter, knowing nothing of them, admits them."""
    p = make(admission="predicted-reuse")
    h = hs(records := chain(4))
    compute(p, records)
    (plan,) = p.take_plans()
    p.complete([result(plan, {1: FailureKind.IO_ERROR})])
    drive(p)
    assert pool_hashes(p.pools["G3"]) == pool_hashes(p.pools["G2"]) == {h[0], h[2], h[3]}
    check(p)


@pytest.mark.parametrize("kind", list(FailureKind), ids=lambda k: k.value)
@pytest.mark.parametrize("pos", [0, 2])
def test_onboard_partial_failure_stops_prefix_and_drops_bad_source(kind, pos):
    p = make()
    h = hs(records := chain(4))
    in_lower_tiers(p, records)
    ticket = p.prepare_onboard(h)
    waiter = p.prepare_onboard(h[:3])                   # waits for the first one's copies
    (plan,) = p.take_plans()
    assert plan.path == "G2->G1" and p.take_finished() == []
    p.complete([result(plan, {pos: kind})])
    assert p.take_plans() == []                         # loaded blocks are in G2 already
    done = {r.ticket: r for r in p.take_finished()}
    assert set(done) == {ticket, waiter}
    for r in done.values():
        assert r.sequence_hashes == h[:pos] and r.sources == ("G2",) * pos
        assert r.failed == [h[pos]] and r.failures[0].kind == kind.value
        assert r.failures[0].tier == "G2" and [b.sequence_hash for b in r.blocks] == h[:pos]
    assert (h[pos] in p.pools["G2"]) == (kind not in DROPS_ON_READ)
    assert pool_hashes(p.pools["G1"]) == set(h) - {h[pos]}
    assert p.pools["G1"].status().active == pos
    for r in done.values():
        r.release()
    assert p.pools["G1"].status().active == 0 and p.idle
    below = "G3" if kind in DROPS_ON_READ else "G2"
    assert p.lookup(h) == ["G1"] * pos + [below] + ["G1"] * (3 - pos)
    check(p)


def test_offload_from_a_source_found_bad_meanwhile_is_not_registered():
    p = make()
    h = hs(records := chain(3))
    compute(p, records)
    p.complete([TransferResult.success(q) for q in p.take_plans()])
    (to_g3,) = p.take_plans()                           # G2->G3, holds the G2 blocks
    p.pools["G1"].reset_blocks(list(reversed(h)))
    p.prepare_onboard(h)
    (onboard,) = p.take_plans()
    p.complete([result(onboard, {1: FailureKind.CHECKSUM_MISMATCH})])
    assert p.quarantined("G2") == 1 and p.lookup(h) == ["G1"]
    p.complete([TransferResult.success(to_g3)])
    drive(p)
    assert h[1] not in p.pools["G3"] and h[1] not in p.pools["G2"]
    assert p.quarantined("G2") == 0
    for r in p.take_finished():
        r.release()
    check(p)


@pytest.mark.parametrize("external", [False, True], ids=["owned", "external"])
def test_onboard_from_a_source_found_bad_meanwhile_is_not_delivered(external):
    p = make(engine_owns_top=external)
    h = hs(records := chain(3))
    if external:
        p.prepare_offload("G1", records, [0, 1, 2])
    else:
        compute(p, records)
    p.complete([TransferResult.success(q) for q in p.take_plans()])
    (to_g3,) = p.take_plans()                           # G2->G3 holds the G2 blocks
    if not external:
        p.pools["G1"].reset_blocks(list(reversed(h)))
    p.prepare_onboard(h, [7, 8, 9] if external else None)
    (onboard,) = p.take_plans()
    p.complete([result(to_g3, {1: FailureKind.CHECKSUM_MISMATCH})])   # G2's h1 is bad
    assert p.quarantined("G2") == 1                      # held by the onboard's read
    p.complete([TransferResult.success(onboard)])       # read before anyone noticed
    drive(p)
    (res,) = p.take_finished()
    res.release()
    assert res.sequence_hashes == h[:1]
    assert external or h[1] not in p.pools["G1"]


# -- 3. out-of-order completion --------------------------------------------------------------

def _ordered_run(order: str):
    p = make(g1=40, g2=40, g3=80)
    old = [chain(4, start=1000 * i) for i in range(3)]
    for records in old:
        compute(p, records)
    drive(p)
    for records in old:
        p.pools["G1"].reset_blocks(list(reversed(hs(records))))
    p.pools["G2"].reset_blocks(list(reversed(hs(old[2]))))      # old[2] only in G3
    for i in range(3, 6):
        compute(p, chain(3, start=1000 * i))
    tickets = [p.prepare_onboard(hs(old[0])), p.prepare_onboard(hs(old[2])),
               p.prepare_onboard(hs(old[0])[:3] + hs(old[1])),   # waits on ticket 1
               p.prepare_onboard(hs(old[1]) + hs(old[2]))]
    rng = random.Random(order)
    outstanding: list[TransferPlan] = []
    finished = []
    while True:
        outstanding += p.take_plans()
        if not outstanding:
            break
        if order == "in_order":
            batch, outstanding = outstanding, []
        elif order == "reverse":
            batch, outstanding = outstanding[-1:], outstanding[:-1]
        else:
            rng.shuffle(outstanding)
            batch, outstanding = outstanding[:1], outstanding[1:]
        # Failures keyed by content, so every order injects the same ones.
        p.complete([result(q, {i: FailureKind.DISK_FULL for i, x in enumerate(q.sequence_hashes)
                               if x % 7 == 0 and q.dst_tier != "G3"}) for q in batch])
        finished += p.take_finished()
    outcome = {r.ticket: (r.sequence_hashes, r.sources, r.failed) for r in finished}
    assert sorted(outcome) == sorted(tickets)
    for r in finished:
        r.release()
    p.settle()
    assert p.idle
    check(p)
    return outcome, {t: p.registry.hashes_in(t) for t in p.tiers}


def test_completion_order_does_not_change_the_outcome():
    expected = _ordered_run("in_order")
    assert any(len(v[0]) for v in expected[0].values())
    for order in ["reverse", "shuffle-1", "shuffle-2", "shuffle-3", "shuffle-4"]:
        assert _ordered_run(order) == expected, order


# -- 4. engine-owned top tier ----------------------------------------------------------------

BAD_IDS = {"short": [1, 2], "long": [1, 2, 3, 4], "duplicate": [1, 2, 1], "negative": [1, -2, 3],
           "bool": [1, True, 3], "float": [1, 2.0, 3], "str": [1, "2", 3], "none": None,
           "none_entry": [1, None, 3]}


@pytest.mark.parametrize("ids", list(BAD_IDS), ids=list(BAD_IDS))
def test_external_bad_engine_ids_are_refused_and_change_nothing(ids):
    p = make(engine_owns_top=True)
    p.prepare_offload("G1", chain(3), [10, 11, 12])
    drive(p)                                             # the chain is in G2 and G3 now
    before = snapshot(p)
    with pytest.raises(PlacementError):
        p.prepare_onboard(hs(chain(3)), BAD_IDS[ids])
    with pytest.raises(PlacementError):
        p.prepare_offload("G1", chain(3, start=50), BAD_IDS[ids])
    assert snapshot(p) == before and p.take_plans() == [] and p.take_finished() == []


def test_external_refuses_owned_calls_and_never_owns_g1():
    p = make(engine_owns_top=True)
    assert "G1" not in p.pools and set(p.pools) == {"G2", "G3"}
    handle = p.pools["G2"].allocate(1)
    before = snapshot(p)
    with pytest.raises(PlacementError):
        p.register(handle)
    with pytest.raises(PlacementError):
        p.prepare_offload("G9", chain(1), [0])
    with pytest.raises(PlacementError):
        p.prepare_offload("G2", chain(1))              # not registered in G2
    assert snapshot(p) == before and not handle.released
    p.pools["G2"].release(handle)
    owned = make()
    with pytest.raises(PlacementError):
        owned.prepare_onboard(hs(chain(2)), [0, 1])
    with pytest.raises(PlacementError):
        owned.prepare_offload("G1", chain(2), [0, 1])


def test_external_offload_reads_engine_ids_until_completed():
    p = make(engine_owns_top=True)
    h = hs(records := chain(4))
    p.prepare_offload("G1", records, [9, 3, 7, 5])
    assert p.engine_blocks_in_use() == {9, 3, 7, 5} and p.pending == 1
    (plan,) = p.take_plans()
    assert plan.path == "G1->G2" and plan.src_block_ids == (9, 3, 7, 5)
    assert p.engine_blocks_in_use() == {9, 3, 7, 5}
    p.complete([result(plan, {1: FailureKind.IO_ERROR})])
    assert p.engine_blocks_in_use() == frozenset()
    (down,) = p.take_plans()
    assert down.path == "G2->G3" and len(down) == 3
    p.complete([TransferResult.success(down)])
    assert pool_hashes(p.pools["G2"]) == {h[0], h[2], h[3]} and p.idle
    assert p.lookup(h) == ["G2"]                         # never G1: the engine's cache
    # Onboard into engine ids: filled exactly, nothing of kvstrata's held afterwards.
    t = p.prepare_onboard(h, [20, 21, 22, 23])          # h[1] failed: prefix is h[0]
    (load,) = p.take_plans()
    assert load.path == "G2->G1" and load.dst_block_ids == (20,)
    assert p.engine_blocks_in_use() == {20}
    p.complete([TransferResult.success(load)])
    (res,) = p.take_finished()
    assert res.ticket == t and res.block_ids == [20] and res.blocks is None
    assert res.release() is None and p.engine_blocks_in_use() == frozenset()
    assert p.pools["G2"].status().active == 0 and p.idle
    check(p)


def test_external_failed_offload_holds_no_g2_slot_and_surplus_cannot_wait():
    p = make(engine_owns_top=True, g2=2)
    p.prepare_offload("G1", chain(3), [0, 1, 2])
    p.prepare_offload("G1", chain(2, start=40), [5, 6])     # G2 is taken by the first copy
    assert p.stats.skipped_for("no_slot") == {"G2": 3} and p.pending == 1
    assert p.engine_blocks_in_use() == {0, 1}           # skipped engine blocks are free
    (plan,) = p.take_plans()
    p.complete([TransferResult.failed(plan, FailureKind.DISK_FULL, "full")])
    g2 = p.pools["G2"].status()
    assert (g2.active, g2.reset) == (0, 2) and p.idle and p.take_plans() == []
    assert p.engine_blocks_in_use() == frozenset() and p.registry.hashes_in("G2") == set()
    check(p)


def test_external_onboard_into_engine_blocks_still_read_is_refused():
    p = make(engine_owns_top=True)
    old = chain(2)
    p.prepare_offload("G1", old, [10, 11])
    drive(p)
    p.prepare_offload("G1", chain(2, start=40), [1, 2])
    assert p.engine_blocks_in_use() == {1, 2}
    with pytest.raises(PlacementError):
        p.prepare_onboard(hs(old), [2, 3])


# -- 5. deferral -----------------------------------------------------------------------------

def test_surplus_is_deferred_then_copied_when_slots_free():
    p = make(g1=8, g2=2, g3=16)
    records = chain(6)
    compute(p, records)
    (plan,) = p.take_plans()
    assert len(plan) == 2 and p.pending == 2             # one copy + one deferred batch
    compute(p, chain(1, start=500))                       # a second batch queues behind it
    assert p.pending == 3 and p.take_plans() == []
    seen = [plan]
    p.complete([TransferResult.success(plan)])
    while not p.idle:
        plans = p.take_plans()
        assert plans, "pending work but no plan handed out"
        seen += plans
        p.complete([TransferResult.success(q) for q in plans])
    copied = [x for q in seen if q.path == "G1->G2" for x in q.sequence_hashes]
    everything = hs(records) + hs(chain(1, start=500))
    assert sorted(copied) == sorted(everything)          # each block copied exactly once
    assert set(everything) <= pool_hashes(p.pools["G3"])
    assert p.stats.skipped_for("evicted") == {} and p.stats.skipped_for("no_slot") == {}
    check(p)


def test_deferred_sources_evicted_meanwhile_are_skipped():
    p = make(g1=8, g2=2, g3=16)
    h = hs(records := chain(6))
    compute(p, records)
    (plan,) = p.take_plans()
    assert p.pools["G1"].reset_blocks([h[3], h[5], h[0]]) == [h[3], h[5]]   # h0 is held
    p.complete([TransferResult.success(plan)])
    drive(p)
    assert p.stats.skipped_for("evicted") == {"G2": 2}
    assert pool_hashes(p.pools["G3"]) == {h[0], h[1], h[2], h[4]} and p.idle
    check(p)


# -- 6. randomized stress --------------------------------------------------------------------

def _random_result(rng: random.Random, plan: TransferPlan) -> TransferResult:
    if rng.random() < 0.65:
        return TransferResult.success(plan)
    bad = {i: rng.choice(list(FailureKind)) for i in range(len(plan)) if rng.random() < 0.5}
    return result(plan, bad, explain=rng.random() < 0.8)


@pytest.mark.parametrize("external", [False, True], ids=["owned", "external"])
@pytest.mark.parametrize("eviction", ["lru", "default"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_stress_settles_consistently(seed, eviction, external):
    rng = random.Random(seed * 1000 + external)
    p = make(g1=12, g2=9, g3=24, eviction=eviction, engine_owns_top=external)
    chains = [chain(rng.randrange(1, 6), start=1000 * i) for i in range(20)]
    outstanding: list[TransferPlan] = []
    results, next_id = [], 0
    given: dict[int, tuple[list[int], list[int] | None]] = {}
    for step in range(300):
        op, records = rng.random(), rng.choice(chains)
        h, ids = hs(records), list(range(next_id, next_id + len(records)))
        next_id += len(h)                                # fresh engine ids every time
        if op < 0.3 and external:
            p.prepare_offload("G1", records, ids)
        elif op < 0.3:
            missing = [r for r in records if r.sequence_hash not in p.pools["G1"]]
            if missing and p.pools["G1"].can_allocate(len(missing)):
                compute(p, missing)
        elif op < 0.55:
            ids = ids if external else None
            given[p.prepare_onboard(h, ids)] = (h, ids)
        elif op < 0.65:
            tier = rng.choice(list(p.pools))
            p.pools[tier].reset_blocks(list(reversed(h)))
        elif outstanding:
            rng.shuffle(outstanding)
            k = rng.randrange(1, len(outstanding) + 1)
            if rng.random() < 0.1:                        # a hostile batch: refused, no change
                before = snapshot(p)
                with pytest.raises(PlacementError):
                    p.complete([TransferResult.success(outstanding[0])] * 2)
                assert snapshot(p) == before
            batch, outstanding = outstanding[:k], outstanding[k:]
            p.complete([_random_result(rng, q) for q in batch])
        outstanding += p.take_plans()
        assert p.pending >= len(outstanding)
        assert p.engine_blocks_in_use() <= set(range(next_id))
        for res in p.take_finished():
            asked, ids = given[res.ticket]
            assert res.sequence_hashes == asked[:len(res)] and set(res.failed) <= set(asked)
            assert not set(res.failed) & set(res.sequence_hashes)
            assert res.block_ids == (ids[:len(res)] if external else
                                     [b.block_id for b in res.blocks])
            if not external:
                assert [b.sequence_hash for b in res.blocks] == res.sequence_hashes
            results.append(res)
            if rng.random() < 0.7:
                res.release()
        if step % 50 == 0:
            for pool in p.pools.values():
                pool.check_invariants()
    while outstanding:
        p.complete([TransferResult.success(q) for q in outstanding])
        outstanding = p.take_plans()
    results += p.take_finished()
    for res in results:
        res.release()
    p.settle()
    assert sum(map(len, results)) and sum(p.stats.failed_kinds.values())   # it did work
    assert p.idle and p.take_plans() == [] and p.engine_blocks_in_use() == frozenset()
    for tier, pool in p.pools.items():
        assert pool.status().active == 0, tier
        assert p.quarantined(tier) == 0, tier
    check(p)

