"""Tenant quotas in the planner (engine-owned G1, no bytes): a tenant at its quota of a tier
evicts its own blocks first, so another tenant keeps its quota's worth; what cannot fit is
skipped for ``quota``; the ledger holds exactly what the tiers hold."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstrata.config import ConfigError, KvConfig, TierConfig
from kvstrata.placement import PlacementError, Planner, drive
from kvstrata.tokens import hash_blocks
from kvstrata.types import BlockRecord

BS = 4


def chain(n: int, start: int) -> list[BlockRecord]:
    local, seqs = hash_blocks(np.arange(start, start + n * BS, dtype="<u4"), BS)
    return [BlockRecord(s, l, p, BS) for s, l, p in zip(seqs, local, [None, *seqs[:-1]])]


def planner(g2=16, g3=0, quota=None, g3_quota=None, named=None, eviction="lru") -> Planner:
    tiers = {"G1": TierConfig(blocks=64), "G2": TierConfig(blocks=g2, tenant_quota=quota)}
    if g3:
        tiers["G3"] = TierConfig(blocks=g3, tenant_quota=g3_quota)
    return Planner(KvConfig(block_size=BS, eviction=eviction, tiers=tiers,
                            tenant_quotas=named or {}), engine_owns_top=True)


def store(p: Planner, records, tenant: str) -> None:
    p.prepare_offload("G1", records, engine_block_ids=list(range(len(records))),
                      tenant=tenant)
    drive(p)


def held(p: Planner, tier: str, records) -> int:
    return sum(r.sequence_hash in p.pools[tier] for r in records)


@pytest.mark.parametrize("eviction", ["lru", "default"])
def test_a_hammering_tenant_evicts_its_own_blocks_and_the_other_keeps_its_share(eviction):
    def run(quota):
        p = planner(g2=16, quota=quota, eviction=eviction)
        quiet = chain(6, start=500_000)
        store(p, quiet, "quiet")
        for i in range(20):                       # 20 conversations of 4 blocks
            store(p, chain(4, start=i * 1000), "busy")
        return p, quiet

    p, quiet = run(None)
    assert held(p, "G2", quiet) == 0              # without quotas the busy tenant wins
    p, quiet = run("50%")
    assert held(p, "G2", quiet) == 6
    usage = p.tenants.usage()["G2"]
    assert usage == {"quiet": 6, "busy": 8}
    assert p.tenants.evicted["G2", "*"] == 20 * 4 - 8
    assert p.tenants.held == {("G2", "*"): 14}
    assert p.stats.skipped_for("quota") == {}
    # the busy tenant kept its newest conversations, whole
    newest = [r for i in (18, 19) for r in chain(4, start=i * 1000)]
    assert held(p, "G2", newest) == 8


def test_a_named_tenant_has_its_own_quota_and_others_share_the_default():
    p = planner(g2=16, quota="25%", named={"gold": {"G2": "75%"}})
    for i in range(10):
        store(p, chain(2, start=i * 1000), "gold")
        store(p, chain(2, start=500 + i * 1000), "free")
    usage = p.tenants.usage()["G2"]
    assert usage == {"gold": 12, "free": 4}
    assert p.tenants.held == {("G2", "gold"): 12, ("G2", "*"): 4}
    assert p.tenants.label("gold") == "gold" and p.tenants.label("free") == "*"


def test_a_tenant_whose_blocks_are_all_in_use_is_refused_for_quota():
    p = planner(g2=16, quota="25%")
    first = chain(4, start=0)
    store(p, first, "a")
    hold = p.pools["G2"].acquire([r.sequence_hash for r in first])   # a load reads them
    store(p, chain(3, start=1000), "a")
    assert p.stats.skipped_for("quota") == {"G2": 3}
    assert p.tenants.refused["G2", "*"] == 3
    assert held(p, "G2", first) == 4
    p.pools["G2"].release(hold)
    store(p, chain(3, start=2000), "a")           # idle again: its oldest make room
    assert p.tenants.usage()["G2"] == {"a": 4}
    assert held(p, "G2", chain(3, start=2000)) == 3


def test_quotas_apply_in_every_tier_the_blocks_go_down_to():
    p = planner(g2=8, g3=32, quota="100%", g3_quota="25%")
    quiet = chain(8, start=50_000)
    store(p, quiet, "quiet")
    for i in range(10):
        store(p, chain(4, start=i * 1000), "busy")
    usage = p.tenants.usage()
    assert usage["G3"] == {"quiet": 8, "busy": 8}
    assert held(p, "G3", quiet) == 8


def test_the_ledger_holds_exactly_what_the_tiers_hold_under_random_traffic():
    rng = random.Random(7)
    p = planner(g2=24, g3=48, quota="40%", g3_quota="30%", named={"t0": {"G3": "60%"}},
                eviction="default")
    for step in range(400):
        tenant = f"t{rng.randrange(4)}"
        start = rng.randrange(60) * 1000 + int(tenant[1]) * 100
        records = chain(rng.randrange(1, 6), start=start)
        store(p, records, tenant)
        if rng.random() < 0.1:
            victims = rng.sample(p.pools["G2"].hashes(), k=min(3, len(p.pools["G2"].hashes())))
            p.pools["G2"].reset_blocks(victims)
        if rng.random() < 0.02:
            p.pools["G3"].clear()
        for tier in ("G2", "G3"):
            usage = p.tenants.usage()[tier]
            assert sum(usage.values()) == len(p.pools[tier].hashes()), (step, tier)
            assert sum(n for (t, _), n in p.tenants.held.items() if t == tier) \
                == sum(usage.values()), (step, tier)
            default, named = KvConfig(block_size=BS, tiers={
                "G1": TierConfig(blocks=64), "G2": TierConfig(blocks=24, tenant_quota="40%"),
                "G3": TierConfig(blocks=48, tenant_quota="30%")},
                tenant_quotas={"t0": {"G3": "60%"}}).tenant_limits(tier)
            for t, n in usage.items():
                assert n <= named.get(t, default), (step, tier, t, n)
        p.pools["G2"].check_invariants()
        p.pools["G3"].check_invariants()


def test_restored_blocks_belong_to_the_recovered_tenant_and_count_against_its_quota():
    """A durable tier's journal keeps no tenant: what it recovered is held by one tenant,
    (recovered), under the quota any unnamed tenant gets (unowned, they counted against
    none, and loaded back up they took a tier from every other tenant)."""
    from kvstrata.placement.tenants import RECOVERED_TENANT

    p = planner(g2=16, quota="25%")
    p.prepare_offload("G1", chain(8, start=0), engine_block_ids=list(range(8)))
    drive(p)                                      # the default tenant "" has a quota too
    assert p.tenants.usage()["G2"] == {"": 4}
    restored = chain(6, start=9000)
    p.restore("G2", list(zip(range(10, 16), restored)))
    assert held(p, "G2", restored) == 6          # all restored, over its quota of 4...
    assert p.tenants.usage()["G2"] == {"": 4, RECOVERED_TENANT: 6}
    # ...so one more of its blocks first evicts its own down to its quota, no one else's
    assert p.tenants.room(p.pools["G2"], RECOVERED_TENANT, 1) == 1
    assert p.tenants.usage()["G2"] == {"": 4, RECOVERED_TENANT: 3}


def test_no_quota_configured_means_no_ledger():
    assert planner().tenants is None


@pytest.mark.parametrize("bad", [7, "0%", "150%", "x%", "lots", "0"])
def test_a_bad_tenant_quota_is_refused(bad):
    with pytest.raises(ConfigError, match="tenant_quota"):
        KvConfig(tiers={"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8,
                                                                    tenant_quota=bad)}).validate()


@pytest.mark.parametrize("quotas, match", [
    ({"a": {"G3": "10%"}}, "not configured"),
    ({"a": {"G1": "10%"}}, "below G1"),
    ({"a": "10%"}, "table of tiers"),
    ({"a": {"G2": "200%"}}, "share"),
    ({1: {"G2": "10%"}}, "string"),
])
def test_bad_named_tenant_quotas_are_refused(quotas, match):
    with pytest.raises(ConfigError, match=match):
        KvConfig(tiers={"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8)},
                 tenant_quotas=quotas).validate()


def test_a_tenant_that_is_not_a_short_string_is_refused():
    p = planner(g2=16, quota="25%")
    with pytest.raises(PlacementError, match="tenant"):
        p.prepare_offload("G1", chain(1, start=0), engine_block_ids=[0], tenant=7)
    with pytest.raises(PlacementError, match="tenant"):
        p.prepare_offload("G1", chain(1, start=0), engine_block_ids=[0], tenant="x" * 300)
    assert p.pending == 0


def test_quotas_come_from_toml(tmp_path):
    from kvstrata.config import load_config

    path = tmp_path / "kv.toml"
    path.write_text('[tiers.G1]\nblocks = 8\n[tiers.G2]\nblocks = 100\ntenant_quota = "10%"\n'
                    '[tenant_quotas.gold]\nG2 = "60%"\n')
    config = load_config(path, env={})
    assert config.tenant_limits("G2") == (10, {"gold": 60})


@pytest.mark.parametrize("eviction", ["lru", "default"])
def test_a_conversation_longer_than_its_quota_keeps_a_reachable_prefix(eviction):
    """One conversation extended a block at a time past its tenant's quota: own-first
    eviction never cuts its prefix (the parent of what is stored is kept, a chain leaves tail
    first), so a lookup still reaches a whole quota's worth, on a plain LRU tier too."""
    p = planner(g2=16, quota="50%", eviction=eviction)
    conversation = chain(16, start=0)
    for i in range(16):
        store(p, conversation[i:i + 1], "a")
    assert p.tenants.usage()["G2"] == {"a": 8}
    assert p.pools["G2"].match_length([r.sequence_hash for r in conversation]) == 8


@pytest.mark.parametrize("eviction", ["lru", "default"])
def test_own_eviction_takes_the_oldest_conversation_tail_first(eviction):
    p = planner(g2=32, quota="25%", eviction=eviction)
    old, new = chain(4, start=0), chain(4, start=1000)
    store(p, old, "a")
    store(p, new, "a")                          # a's 8: at its quota
    store(p, chain(2, start=2000), "a")         # needs 2: the old conversation's last two
    assert held(p, "G2", new) == 4
    assert [r.sequence_hash in p.pools["G2"] for r in old] == [True, True, False, False]


def test_own_eviction_costs_what_it_evicts_not_what_the_tenant_holds():
    """A tenant at its quota holding one long chain: storing one more block resets a
    handful of blocks, not the chain (the ledger keeps its leaves in order)."""
    p = planner(g2=4096, quota="50%", eviction="default")
    store(p, chain(2048, start=0), "a")
    pool = p.pools["G2"]
    calls = []
    real = pool.reset_blocks
    pool.reset_blocks = lambda hashes: calls.append(len(tuple(hashes))) or real(hashes)
    store(p, chain(1, start=10**6), "a")
    assert sum(calls) <= 4
    assert p.tenants.usage()["G2"] == {"a": 2048}


def test_blocks_fetched_from_outside_are_held_to_their_tenants_quota():
    p = Planner(KvConfig(block_size=BS, eviction="lru", tiers={
        "G1": TierConfig(blocks=64), "G2": TierConfig(blocks=32, tenant_quota="25%"),
        "G3": TierConfig(blocks=64)}))
    g2 = p.pools["G2"]
    for start in (0, 1000, 2000):
        records = chain(6, start=start)
        slots = g2.allocate(len(records))
        slots.apply_token_blocks(records)
        g2.release(p.register_fetched(slots, tenant="a"))
        drive(p)
    assert p.tenants.usage()["G2"] == {"a": 8}
    assert g2.status().active == 0


def test_a_key_addressed_tier_takes_no_quota():
    with pytest.raises(ConfigError, match="G4"):
        KvConfig(tiers={"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8),
                        "G4": TierConfig(blocks=8, url="http://127.0.0.1:8333/bucket",
                                         tenant_quota="50%")}).validate()


@pytest.mark.parametrize("bad, match", [
    ("50", "did you mean '50%'"), ("1KiB", "allows no block"), ("0.0001%", "allows no block"),
    ("9" * 400, "size"), ("1e2%", "share"), ("1_0%", "share"), ("\u0665\u0660%", "share"),
])
def test_a_quota_that_allows_no_block_or_does_not_parse_is_one_problem_line(bad, match):
    with pytest.raises(ConfigError, match=match) as caught:
        KvConfig(block_size=BS, tiers={"G1": TierConfig(blocks=8),
                                       "G2": TierConfig(blocks=100, tenant_quota=bad)}).validate()
    assert len(caught.value.problems) == 1


def test_the_others_label_cannot_be_named():
    with pytest.raises(ConfigError, match="'\\*'"):
        KvConfig(tiers={"G1": TierConfig(blocks=8), "G2": TierConfig(blocks=8)},
                 tenant_quotas={"*": {"G2": "10%"}}).validate()


def test_a_block_whose_child_is_on_its_way_is_not_its_tenants_leaf():
    """C (extending B) is still being copied when D is offered at quota: B is not a leaf
    (its child is coming), so it stays and the conversation stays reachable."""
    from kvstrata.protocol import TransferResult

    p = planner(g2=30, quota="10%")                        # a quota of 3
    a, b, c, d = chain(4, start=0)
    store(p, [a, b], "t")
    p.prepare_offload("G1", [c], engine_block_ids=[2], tenant="t")
    in_flight = p.take_plans()
    p.prepare_offload("G1", [d], engine_block_ids=[3], tenant="t")
    assert b.sequence_hash in p.pools["G2"]
    p.complete([TransferResult.success(plan) for plan in in_flight])
    drive(p)
    assert p.pools["G2"].match_length([r.sequence_hash for r in (a, b, c, d)]) == 3


def test_a_parent_stored_after_its_child_knows_it_is_extended():
    """A's first copy fails, B's lands; A is stored again later: A knows B extends it, so
    own eviction takes B (the tail) before A."""
    from kvstrata.protocol.results import BlockFailure, FailureKind
    from kvstrata.protocol import TransferResult

    p = planner(g2=40, quota="10%")                        # a quota of 4
    a, b = chain(2, start=0)
    p.prepare_offload("G1", [a, b], engine_block_ids=[0, 1], tenant="t")
    [plan] = p.take_plans()
    p.complete([TransferResult(plan, (False, True), (None, None), 0, 0.0, (
        BlockFailure(0, plan.dst_block_ids[0], FailureKind.IO_ERROR, "x"),))])
    store(p, [a, b], "t")                                  # A arrives now
    p.prepare_onboard([a.sequence_hash, b.sequence_hash], engine_block_ids=[100, 101])
    drive(p)
    for result in p.take_finished():
        result.release()
    store(p, chain(2, start=10_000), "t")
    store(p, chain(1, start=20_000), "t")                  # 5 of 4: one own eviction
    assert a.sequence_hash in p.pools["G2"] and b.sequence_hash not in p.pools["G2"]


def test_a_batch_with_a_held_block_never_evicts_it_to_make_room():
    p = Planner(KvConfig(block_size=BS, eviction="default", tiers={
        "G1": TierConfig(blocks=64), "G2": TierConfig(blocks=40, tenant_quota="5%")}),
        engine_owns_top=True)                              # a quota of 2
    a, b, x = chain(1, start=0)[0], chain(1, start=1000)[0], chain(1, start=2000)[0]
    store(p, [a], "t")
    store(p, [b], "t")
    g2 = p.pools["G2"]
    slots = g2.allocate(2)
    slots.apply_token_blocks([a, x])
    g2.release(p.register_fetched(slots, tenant="t"))
    drive(p)
    assert p.tenants.usage()["G2"] == {"t": 2}
    assert a.sequence_hash in g2


def test_busy_leaves_count_as_used_and_idle_ones_still_go():
    p = planner(g2=256, quota="50%", eviction="lru")
    busy = [chain(1, start=1000 * i) for i in range(80)]
    for c in busy:
        store(p, c, "a")
    idle = [chain(1, start=500_000 + 1000 * i) for i in range(48)]
    for c in idle:
        store(p, c, "a")                                   # 128: at its quota
    hold = p.pools["G2"].acquire([c[0].sequence_hash for c in busy])
    store(p, chain(1, start=900_000), "a")
    assert p.tenants.evicted["G2", "*"] == 1
    assert all(c[0].sequence_hash in p.pools["G2"] for c in busy)
    p.pools["G2"].release(hold)


def test_a_tenants_heap_stays_bounded_when_others_extend_its_blocks():
    p = planner(g2=64, quota="2%", eviction="default")     # a quota of one block
    shared = chain(1, start=0)
    store(p, shared, "x")
    for k in range(3000):
        local, seqs = hash_blocks(np.array([*range(BS), *([10**6 + k] * BS)], dtype="<u4"), BS)
        store(p, [shared[0], BlockRecord(seqs[1], local[1], seqs[0], BS)], "y")
    book = p.tenants._books["G2"]
    assert len(book.leaves.get("x", [])) < 200


# -- blocks no tier knows the tenant of; ownership across a failed onboard; room_for -------


def owned_planner(tiers: dict, eviction: str = "lru") -> Planner:
    return Planner(KvConfig(block_size=BS, eviction=eviction, admission="always",
                            tiers=tiers))


def compute(p: Planner, records, tenant: str) -> None:
    g1 = p.pools["G1"]
    blocks = g1.allocate(len(records))
    blocks.apply_token_blocks(records)
    g1.release(p.register(blocks, tenant=tenant))
    drive(p)


def test_blocks_learned_from_g4_belong_to_the_recovered_tenant_under_its_quota():
    """The reviewer's repro_quota_bypass_learned_g4.py: blocks another worker put in G4,
    onboarded, were offered down owned by no one, held to no quota, and evicted a tenant
    within its quota although the quotas (2 + 2) add up to G2's 4 blocks."""
    from kvstrata.placement.tenants import RECOVERED_TENANT

    p = owned_planner({"G1": TierConfig(blocks=8),
                       "G2": TierConfig(blocks=4, tenant_quota="50%"),   # 2 blocks a tenant
                       "G4": TierConfig(blocks=16)})
    b = chain(2, start=0)
    compute(p, b, "b")
    shared = chain(4, start=5000)
    assert p.learn("G4", shared) == 4
    p.prepare_onboard([r.sequence_hash for r in shared])
    drive(p)
    for result in p.take_finished():
        assert len(result) == 4
        result.release()
    p.settle()
    drive(p)
    assert held(p, "G2", b) == 2                  # b keeps its quota's worth
    assert p.tenants.usage()["G2"] == {"b": 2, RECOVERED_TENANT: 2}
    book = p.tenants._books["G2"]
    assert all(book.owner.get(h) is not None for h in p.pools["G2"].hashes())
    assert p.tenants.refused["G2", "*"] == 2 == p.stats.skipped_for("quota")["G2"]
    p.pools["G2"].check_invariants()


def test_blocks_fetched_without_a_tenant_no_tier_knows_are_the_recovered_tenants():
    """register_fetched(tenant=None) of blocks no tier knows: stored owned by
    RECOVERED_TENANT, under its quota, not by nobody."""
    from kvstrata.placement.tenants import RECOVERED_TENANT

    p = owned_planner({"G1": TierConfig(blocks=8),
                       "G2": TierConfig(blocks=8, tenant_quota="25%"),
                       "G3": TierConfig(blocks=8)})
    g2 = p.pools["G2"]
    records = chain(4, start=7000)
    slots = g2.allocate(4)
    slots.apply_token_blocks(records)
    kept = p.register_fetched(slots)
    assert len(kept) == 2                         # its quota of G2
    g2.release(kept)
    drive(p)
    assert p.tenants.usage()["G2"] == {RECOVERED_TENANT: 2}
    assert p.tenants.usage()["G3"] == {RECOVERED_TENANT: 2}   # offered down as its too


@pytest.mark.parametrize("eviction", ["default", "lru"])
def test_a_failed_onboard_keeps_the_owner_of_the_blocks_it_loaded(eviction):
    """The reviewer's repro_quota_bypass_failed_onboard.py: a block loaded into G1 whose
    prefix failed its check in the same copy had its G2 copy dropped with the prefix (and
    its owner with it), so it was offered back down owned by nobody: tenant a held 3 blocks
    of G2 with a quota of 2."""
    from kvstrata.protocol.results import BlockFailure, FailureKind, TransferResult

    p = owned_planner({"G1": TierConfig(blocks=8),
                       "G2": TierConfig(blocks=8, tenant_quota="25%")}, eviction)
    g1, g2 = p.pools["G1"], p.pools["G2"]
    a = chain(2, start=0)
    compute(p, a, "a")
    assert p.tenants.usage()["G2"] == {"a": 2}
    g1.reset_blocks([a[1].sequence_hash, a[0].sequence_hash])
    p.prepare_onboard([r.sequence_hash for r in a])
    (plan,) = p.take_plans()
    ids = plan.dst_block_ids
    p.complete([TransferResult(plan, (False, True), (None, None), 0, 0.0,
                               (BlockFailure(0, ids[0], FailureKind.CHECKSUM_MISMATCH, "bad"),))])
    drive(p)
    for result in p.take_finished():
        result.release()
    p.settle()
    if a[1].sequence_hash in g2:                  # offered back down: still a's
        assert p.tenants._books["G2"].owner[a[1].sequence_hash] == "a"
    compute(p, chain(2, start=100), "a")
    mine = [h for h in g2.hashes()]
    assert len(mine) <= 2 and p.tenants.usage()["G2"] == {"a": len(mine)}
    g2.check_invariants()


def test_room_for_is_a_question_that_counts_nothing():
    """The reviewer's repro_room_for_counters.py: asking counted a refusal in the ledger
    each time (and none in the stats)."""
    p = owned_planner({"G1": TierConfig(blocks=8),
                       "G2": TierConfig(blocks=8, tenant_quota="25%")})
    records = chain(5, start=0)
    assert p.room_for("G2", records, "a") == 2
    assert p.room_for("G2", records, "a") == 2
    assert sum(p.tenants.refused.values()) == 0 and p.stats.skipped_for("quota") == {}
    # a caller that stores only what fits counts the rest once, in both places
    assert p.room_for("G2", records, "a", refuse=True) == 2
    assert p.tenants.refused["G2", "*"] == 3 == p.stats.skipped_for("quota")["G2"]
