"""The planner on its own (owned G1, no bytes): results checked before anything changes,
partial failures, out-of-order completion, deferral, and a seeded random stress run."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kvstrata.config import KvConfig, TierConfig
from kvstrata.placement import PlacementError, Planner, drive
from kvstrata.protocol import TransferPlan, TransferResult
from kvstrata.protocol.results import BlockFailure, FailureKind
from kvstrata.tokens import hash_blocks
from kvstrata.types import BlockRecord

BS = 4


def chain(n: int, start: int = 0) -> list[BlockRecord]:
    local, seqs = hash_blocks(np.arange(start, start + n * BS, dtype="<u4"), BS)
    return [BlockRecord(s, l, p, BS) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]


def planner(g1=8, g2=8, g3=32, **kw) -> Planner:
    tiers = {"G1": TierConfig(blocks=g1), "G2": TierConfig(blocks=g2)}
    if g3:
        tiers["G3"] = TierConfig(blocks=g3)
    return Planner(KvConfig(block_size=BS, eviction="lru", tiers=tiers), **kw)


def compute(p: Planner, records) -> None:
    g1 = p.pools["G1"]
    blocks = g1.allocate(len(records))
    blocks.apply_token_blocks(records)
    g1.release(p.register(blocks))


def snapshot(p: Planner):
    return ({t: dataclasses.astuple(pool.status()) for t, pool in p.pools.items()},
            {t: p.registry.hashes_in(t) for t in p.tiers}, p.pending)


def assert_consistent(p: Planner) -> None:
    for tier, pool in p.pools.items():
        pool.check_invariants()
        held = {h for h in p.registry.hashes_in(tier)}
        assert all(h in pool for h in held)


def failed(plan: TransferPlan, positions, kind=FailureKind.IO_ERROR) -> TransferResult:
    ok = tuple(i not in positions for i in range(len(plan)))
    ids = plan.dst_block_ids or (-1,) * len(plan)
    return TransferResult(plan, ok, (None,) * len(plan), 0, 0.0,
                          tuple(BlockFailure(i, ids[i], kind, "injected") for i in positions))


def test_hostile_results_are_refused_and_change_nothing():
    p = planner()
    compute(p, chain(3))
    (plan,) = p.take_plans()
    before = snapshot(p)
    other = dataclasses.replace(plan, dst_block_ids=tuple(reversed(plan.dst_block_ids)))
    n = len(plan)
    hostile = [
        [TransferResult.success(dataclasses.replace(plan, job_id=plan.job_id + 100))],
        [TransferResult.success(plan), TransferResult.success(plan)],
        [TransferResult.success(other)],
        [TransferResult(plan, (True,) * (n - 1), (None,) * (n - 1), 0, 0.0)],
        [TransferResult(plan, (1,) * n, (None,) * n, 0, 0.0)],
        [TransferResult(plan, (True,) * n, (None,) * n, 0, 0.0,
                        (BlockFailure(0, 0, FailureKind.IO_ERROR, "ok block"),))],
        [TransferResult(plan, (False,) + (True,) * (n - 1), (None,) * n, 0, 0.0,
                        (BlockFailure(n + 3, 0, FailureKind.IO_ERROR, "out of range"),))],
        [plan],
        [TransferResult.success(plan), "junk"],       # a good result beside a bad one
    ]
    for results in hostile:
        with pytest.raises(PlacementError):
            p.complete(results)
        assert snapshot(p) == before
    p.complete([TransferResult.success(plan)])          # the real one still applies
    drive(p)
    with pytest.raises(PlacementError):                 # and only once
        p.complete([TransferResult.success(plan)])
    assert p.idle and p.lookup([r.sequence_hash for r in chain(3)]) == ["G1"] * 3
    assert all(r.sequence_hash in p.pools["G3"] for r in chain(3))
    assert_consistent(p)


def test_failed_offload_blocks_are_not_registered_and_free_their_slots():
    p = planner()
    records = chain(4)
    compute(p, records)
    (plan,) = p.take_plans()
    p.complete([failed(plan, {1, 3})])
    drive(p)
    g2 = p.pools["G2"]
    assert [r.sequence_hash in g2 for r in records] == [True, False, True, False]
    assert g2.status().active == 0 and g2.status().reset == g2.capacity - 2
    assert p.stats.paths["G1->G2"].failed_blocks == 2
    assert p.stats.failed_kinds["G1->G2", "io_error"] == 2
    assert p.idle
    assert_consistent(p)


def test_failed_onboard_read_drops_the_source_and_stops_the_prefix():
    p = planner(g1=8)
    records = chain(4)
    hashes = [r.sequence_hash for r in records]
    compute(p, records)
    drive(p)
    p.pools["G1"].reset_blocks(list(reversed(hashes)))
    ticket = p.prepare_onboard(hashes)
    (plan,) = p.take_plans()
    assert plan.path == "G2->G1"
    p.complete([failed(plan, {2}, FailureKind.CHECKSUM_MISMATCH)])
    drive(p)
    (result,) = p.take_finished()
    assert result.ticket == ticket and len(result) == 2 and result.failed == [hashes[2]]
    assert result.failures[0].kind == "checksum_mismatch" and result.failures[0].tier == "G2"
    assert hashes[2] not in p.pools["G2"]
    result.release()
    # G3's copy of the bad block is still good; the block after it arrived (registered in G1)
    # but is not part of the delivered prefix.
    assert p.lookup(hashes) == ["G1", "G1", "G3", "G1"]
    assert_consistent(p)


def test_completion_order_does_not_change_the_outcome():
    def run(order_seed: int | None):
        p = planner(g1=16, g2=6, g3=40)
        outstanding = []
        for start in range(0, 60, 12):
            compute(p, chain(3, start=start))
            outstanding += p.take_plans()
        rng = random.Random(order_seed)
        while outstanding or not p.idle:
            if order_seed is None:
                batch, outstanding = outstanding, []
            else:
                rng.shuffle(outstanding)
                batch, outstanding = outstanding[:1], outstanding[1:]
            p.complete([TransferResult.success(plan) for plan in batch])
            outstanding += p.take_plans()
        assert_consistent(p)
        return {t: len(p.registry.hashes_in(t)) for t in p.tiers}

    in_order = run(None)
    assert in_order["G2"] == 6 and in_order["G3"] == 15
    for seed in range(5):
        assert run(seed) == in_order


def test_surplus_waits_for_slots_and_evicted_sources_are_skipped():
    p = planner(g1=8, g2=2, g3=16)
    records = chain(6)
    compute(p, records)
    (plan,) = p.take_plans()
    assert len(plan) == 2 and p.pending == 2            # one copy, one deferred batch
    # 2 G1 blocks are held by the copy; taking the other 6 slots evicts the deferred sources.
    p.pools["G1"].allocate(6)
    p.complete([TransferResult.success(plan)])
    drive(p)
    assert p.stats.skipped_for("evicted") == {"G2": 4}
    assert p.idle
    assert_consistent(p)


def test_random_stress_settles_to_a_consistent_state():
    rng = random.Random(20261125)
    p = planner(g1=12, g2=10, g3=30)
    chains = [chain(rng.randrange(1, 6), start=1000 * i) for i in range(25)]
    outstanding: list[TransferPlan] = []
    results = []
    for _ in range(400):
        op = rng.random()
        records = rng.choice(chains)
        hashes = [r.sequence_hash for r in records]
        if op < 0.3:
            missing = [r for r in records if r.sequence_hash not in p.pools["G1"]]
            if missing and p.pools["G1"].can_allocate(len(missing)):
                compute(p, missing)
        elif op < 0.55:
            p.prepare_onboard(hashes)
        elif op < 0.65:
            tier = rng.choice(p.tiers)
            p.pools[tier].reset_blocks(list(reversed(hashes)))
        elif outstanding:
            rng.shuffle(outstanding)
            k = rng.randrange(1, len(outstanding) + 1)
            batch, outstanding = outstanding[:k], outstanding[k:]
            done = []
            for plan in batch:
                if rng.random() < 0.2:
                    bad = {i for i in range(len(plan)) if rng.random() < 0.5}
                    kind = rng.choice(list(FailureKind))
                    done.append(failed(plan, bad, kind) if bad else
                                TransferResult.success(plan))
                else:
                    done.append(TransferResult.success(plan))
            p.complete(done)
        outstanding += p.take_plans()
        for result in p.take_finished():
            results.append(result)
            assert len(result) <= result.requested
            if rng.random() < 0.7:
                result.release()
    while outstanding:
        p.complete([TransferResult.success(plan) for plan in outstanding])
        outstanding = p.take_plans()
    results += p.take_finished()
    for result in results:
        result.release()
    p.settle()                    # quarantined blocks whose last holder just left are dropped
    assert p.idle
    for tier, pool in p.pools.items():
        assert pool.status().active == 0, tier
        pool.check_invariants()
        assert p.registry.hashes_in(tier) == {h for h in p.registry.hashes_in(tier)
                                              if h in pool}
        assert p.quarantined(tier) == 0


def test_deferred_blocks_are_copied_oldest_first():
    p = planner(g1=16, g2=2, g3=0)
    first, later = chain(6), chain(2, start=500)
    compute(p, first)
    copied = []
    plans = p.take_plans()
    compute(p, later)                          # deferred behind the rest of ``first``
    plans += p.take_plans()
    while plans:
        plan, plans = plans[0], plans[1:]
        copied += plan.sequence_hashes
        p.complete([TransferResult.success(plan)])
        plans += p.take_plans()
    assert copied == [r.sequence_hash for r in first + later]
    assert p.idle


@pytest.mark.parametrize("eviction", ["lru", "default"])
def test_a_prompt_longer_than_the_top_tier_brings_back_what_fits(eviction):
    """A returning prompt longer than G1, whose tail G1 still holds and whose head only G2
    does: the onboard delivers the longest prefix G1 can hold at once. Holding the tail
    first left no slot for the head's copies, and it delivered nothing."""
    p = Planner(KvConfig(block_size=BS, eviction=eviction,
                         tiers={"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=32)}))
    records = chain(20)
    hashes = [r.sequence_hash for r in records]
    for start in range(0, 20, 4):                 # computed 4 blocks at a time
        compute(p, records[start:start + 4])
        drive(p)
    assert p.lookup(hashes)[-1] == "G1" and p.lookup(hashes)[0] == "G2"
    p.prepare_onboard(hashes)
    drive(p)
    (result,) = p.take_finished()
    assert len(result) == 8 and result.sequence_hashes == hashes[:8]
    result.release()
    assert_consistent(p)


def test_the_cut_counts_resident_blocks_eviction_could_not_take_anyway():
    """A resident block that is the parent of a block in use (a G1->G2 copy in flight) is
    out of eviction's reach under a leaf-first policy: holding it costs no slot, so the
    prefix is not cut for it (the first re-planning counted it and delivered 4 of 7)."""
    p = Planner(KvConfig(block_size=BS, eviction="default",
                         tiers={"G1": TierConfig(blocks=5), "G2": TierConfig(blocks=32)}))
    records = chain(7)
    hashes = [r.sequence_hash for r in records]
    compute(p, records[2:7])
    drive(p)                                    # blocks 3..7 in G2
    p.pools["G1"].clear()
    compute(p, records[:1])
    drive(p)                                    # block 1 in G1 and G2
    compute(p, records[1:2])                    # block 2 in G1, its copy to G2 in flight
    plans = p.take_plans()
    p.prepare_onboard(hashes)
    plans += p.take_plans()
    while plans:
        p.complete([TransferResult.success(plan) for plan in plans])
        plans = p.take_plans()
    (result,) = p.take_finished()
    assert len(result) == 5 and result.sequence_hashes == hashes[:5]
    result.release()
    assert_consistent(p)
