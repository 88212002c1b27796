import pytest

from kvstrata.logical.policy import (
    PolicyError,
    SecondOfferAdmission,
    make_admission,
    make_eviction,
)
from kvstrata.logical.pool import BlockPool
from kvstrata.logical.registry import BlockRecord


def store(pool, h, parent=None):
    handle = pool.allocate(1)
    handle.apply_token_blocks([BlockRecord(h, h, parent, 1)])
    pool.release(pool.register(handle))


def test_unknown_names_are_typed_errors():
    with pytest.raises(PolicyError, match="unknown eviction"):
        make_eviction("mru", 4)
    with pytest.raises(PolicyError, match="unknown admission"):
        make_admission("never", 4)
    with pytest.raises(PolicyError):
        SecondOfferAdmission(0)


def test_second_offer_admits_on_second_offer_within_history():
    adm = SecondOfferAdmission(capacity=1, history=2)
    assert not adm.admit(1)
    assert adm.admit(1)
    assert not adm.admit(1)  # admitted offers are forgotten: a third offer starts over
    for h in (2, 3, 4):  # pushes 1's record out of the 2-entry history
        adm.admit(h)
    assert not adm.admit(2)  # 2 was forgotten too (FIFO of 2: holds 3, 4)


def test_lfu_keeps_the_frequently_used_block():
    pool = BlockPool("G1", 2, 1, eviction=make_eviction("lfu", 2))
    store(pool, 1)
    store(pool, 2)
    for _ in range(3):
        pool.touch([1])
    pool.touch([2])  # 2 is more recent, 1 more frequent
    store(pool, 3)
    assert 1 in pool and 2 not in pool


def test_lfu_ghost_restores_count_of_a_returning_block():
    pool = BlockPool("G1", 1, 1, eviction=make_eviction("lfu", 1))
    store(pool, 1)
    pool.touch([1, 1, 1])  # f = 4
    store(pool, 2)  # evicts 1 into the ghost with f = 4
    store(pool, 1)  # 1 returns: its count resumes (f = 5), so it beats 2 (f = 1) next time
    assert 1 in pool and pool.lookup(1).policy_state == 5


def test_lfu_ages_old_popularity_away():
    pool = BlockPool("G1", 2, 1, eviction=make_eviction("lfu", 2))
    store(pool, 100)
    pool.touch([100] * 3)  # popular long ago: key 4
    next_id = 1
    for _ in range(8):  # a stream of blocks each used twice raises the age L past 100's key
        store(pool, next_id)
        pool.touch([next_id])
        next_id += 1
    assert 100 not in pool


def test_lru_policy_counts_no_hits_and_evicts_oldest():
    pool = BlockPool("G1", 2, 1, eviction=make_eviction("lru", 2))
    store(pool, 1)
    store(pool, 2)
    pool.touch([1] * 5)
    store(pool, 3)
    assert 1 in pool and 2 not in pool


def _tier(capacity, eviction="adaptive", admission="adaptive", sample=1):
    """A pool and admission filter sharing one duel that samples every request."""
    from kvstrata.logical.adaptive import DuelingAdmission, DuelingEviction, PolicyDuel

    evictions = ("lru", "lfu") if eviction == "adaptive" else (eviction,)
    admissions = ("always", "second-offer") if admission == "adaptive" else (admission,)
    duel = PolicyDuel(capacity, evictions, admissions, sample=sample)
    policy = DuelingEviction(capacity, duel) if eviction == "adaptive" else make_eviction(eviction, capacity)
    adm = DuelingAdmission(capacity, duel) if admission == "adaptive" else make_admission(admission, capacity)
    return BlockPool("G1", capacity, 1, eviction=policy), adm, duel


def _serve(tier, hashes):
    pool, adm, duel = tier
    duel.observe_request(hashes)
    for h in hashes:
        if h in pool:
            pool.touch([h])
        elif adm.admit(h):
            store(pool, h)
    pool.check_invariants()


def test_duel_turns_second_offer_on_when_one_hit_blocks_flood():
    tier = _tier(40, eviction="lru")
    hot = list(range(1, 31))
    fresh = 10_000
    for _ in range(60):  # a hot set slightly smaller than the tier, between floods of one-offs
        _serve(tier, hot)
        _serve(tier, list(range(fresh, fresh + 30)))
        fresh += 30
    assert tier[2].admission == "second-offer"


def test_duel_keeps_admitting_all_when_everything_fits():
    tier = _tier(100, eviction="lru")
    for turn in range(30):  # growing conversations that fit: every first reuse matters
        for conv in range(3):
            base = conv * 1000
            _serve(tier, list(range(base, base + turn + 1)))
    assert tier[2].admission == "always"


def test_duel_picks_frequency_when_a_hot_set_competes_with_a_scan():
    tier = _tier(20, admission="always")
    hot = list(range(1, 11))
    fresh = 10_000
    for _ in range(40):
        _serve(tier, hot)
        for _ in range(2):  # scans of 15 one-off blocks push LRU to drop the hot set
            _serve(tier, list(range(fresh, fresh + 15)))
            fresh += 15
    assert tier[2].eviction == "lfu"


def test_duel_picks_recency_when_old_favourites_go_cold():
    tier = _tier(20, admission="always")
    # Phase 1: a set used many times; phase 2: short sessions re-used once, soon after.
    for _ in range(30):
        _serve(tier, list(range(1, 16)))
    fresh = 10_000
    for _ in range(200):
        session = list(range(fresh, fresh + 6))
        _serve(tier, session)
        _serve(tier, list(range(fresh + 1000, fresh + 1006)))
        _serve(tier, session)
        fresh += 6
    assert tier[2].eviction == "lru"


def test_adaptive_by_name_builds_working_policies():
    from kvstrata.logical.policy import make_tier_policies

    policies = make_tier_policies("adaptive", "adaptive", 8)
    assert policies.observe_request is not None
    pool = BlockPool("G1", 8, 1, eviction=policies.eviction)
    for h in range(1, 30):
        policies.observe_request([h, h + 1])
        if policies.admission.admit(h):
            store(pool, h)
    pool.check_invariants()
    assert make_eviction("adaptive", 4).name == "adaptive"
    assert make_admission("adaptive", 4).name == "adaptive"



@pytest.mark.parametrize("eviction", ["lru", "default", "lfu"])
def test_every_fixed_order_takes_an_adaptive_admission(eviction):
    """``--policy default --admission adaptive`` once failed with a KeyError: the duel had no
    shadow for the default order. Each fixed order now duels its admission."""
    from kvstrata.logical.eviction import EVICTION_ORDERS
    from kvstrata.logical.policy import make_tier_policies

    assert eviction in EVICTION_ORDERS
    policies = make_tier_policies(eviction, "adaptive", 40)
    tier = (BlockPool("G1", 40, 1, eviction=policies.eviction), policies.admission,
            policies.observe_request.__self__)
    fresh = 10_000
    for _ in range(60):  # a hot set of 30 blocks between floods of one-offs, 3 per request
        for k in range(10):
            _serve(tier, [7 * k, 7 * k + 1, 7 * k + 2])
        for _ in range(10):
            _serve(tier, [fresh, fresh + 1, fresh + 2])
            fresh += 3
    assert tier[2].admission == "second-offer"

# -- the duel's shadow caches are exact stand-ins for one-tier pools ---------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstrata.logical.adaptive import _shadow  # noqa: E402
from kvstrata.logical.filters import ADMISSION_FILTERS  # noqa: E402
from kvstrata.logical.eviction import EVICTION_ORDERS  # noqa: E402
from kvstrata.logical.registry import UNOBSERVED  # noqa: E402


class _PoolShadow:
    """The reference: a real BlockPool served the way the duel serves a request."""

    def __init__(self, capacity, eviction, admission):
        self.pool = BlockPool("shadow", capacity, 1, eviction=EVICTION_ORDERS[eviction](capacity),
                              registry=UNOBSERVED)
        self.admission = ADMISSION_FILTERS[admission](capacity)

    def serve(self, hashes):
        if self.admission.learns_from_requests:        # as the planner shows it a request
            self.admission.observe_request(hashes)
        pool, admit = self.pool, self.admission.admit
        hits = pool.match_length(hashes)
        parent = None
        for h in hashes:
            if h in pool:
                pool.touch((h,))
            elif admit(h):
                handle = pool.allocate(1)
                handle.apply_token_blocks([BlockRecord(h, h, parent, 1)])
                pool.release(pool.register(handle))
            parent = h
        return hits

    def held(self):
        return set(self.pool.hashes())


_requests = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(0, 3)).map(
        # (conversation, length, suffix): a prefix shared by a conversation's turns, then a
        # few blocks of its own; small ids so blocks repeat and evictions tie
        lambda t: [t[0] * 100 + i for i in range(t[1])] + [1000 + t[0] * 10 + j for j in range(t[2])]),
    max_size=60)


@settings(max_examples=150, deadline=None)
@given(requests=_requests, capacity=st.integers(1, 9), eviction=st.sampled_from(["lru", "lfu"]),
       admission=st.sampled_from(["always", "second-offer", "predicted-reuse"]))
def test_shadow_caches_serve_exactly_as_a_pool(requests, capacity, eviction, admission):
    ref = _PoolShadow(capacity, eviction, admission)
    fast = _shadow(capacity, eviction, admission)
    for hashes in requests:
        assert fast.serve(hashes) == ref.serve(hashes)
    held = fast.held()
    if eviction == "lru":
        live = [h for s, h in zip(fast._queue[fast._head::2], fast._queue[fast._head + 1::2])
                if fast._stamp.get(h) == s]
        assert sorted(live) == sorted(held)      # each held hash once in the queue
        fast._prune()
        assert len(fast._queue) == 2 * len(held)  # pruned to the live pairs
    else:
        assert set(fast._key) == held == {h for b in fast._buckets.values() for h in b}
    assert held == ref.held()


# -- the adaptive order evicts exactly as two separate orders would ----------------------------

from kvstrata.logical.adaptive import DuelingEviction  # noqa: E402
from kvstrata.logical.slots import SlotStore  # noqa: E402
from kvstrata.logical.eviction import AgedFrequencyEviction, EvictionPolicy, LruEviction  # noqa: E402


class _Leader:
    """A duel stand-in whose leader the test sets."""

    eviction = "lru"


class _TwoOrders(EvictionPolicy):
    """The reference: an LRU order (a dict in release order) and an aged-LFU order (a dict
    of slot -> (key, tick), its victim found by a scan) kept side by side, victims from the
    leader's, the other one kept in step."""

    def __init__(self, capacity, leader):
        self.leader = leader
        self.lru, self.lfu = {}, {}
        self.age = 0
        self.ghost, self.ghost_size = {}, 4 * capacity

    def attach(self, store):
        super().attach(store)
        self.count, self.ticks, self.seq = store.count, store.tick, store.seq

    def registered(self, slot):
        self.count[slot] = self.ghost.pop(self.seq[slot], 0) + 1

    def record_hit(self, slot):
        self.count[slot] += 1

    def insert(self, slot):
        self.remove(slot)
        self.lru[slot] = None
        self.lfu[slot] = (self.age + self.count[slot], self.ticks[slot])

    def remove(self, slot):
        self.lru.pop(slot, None)
        self.lfu.pop(slot, None)

    def victim(self):
        if not self.lru:
            return None
        if self.leader.eviction == "lfu":
            slot = min(self.lfu, key=lambda s: (*self.lfu[s], s))
            self.age = self.lfu[slot][0]
        else:
            slot = next(iter(self.lru))
        self.remove(slot)
        h = self.seq[slot]
        self.ghost.pop(h, None)
        self.ghost[h] = self.count[slot]
        if len(self.ghost) > self.ghost_size:
            del self.ghost[next(iter(self.ghost))]
        return slot

    def __len__(self):
        return len(self.lru)

    def members(self):
        return set(self.lru)


_hashes = st.lists(st.integers(1, 24), max_size=6)
_ops = st.lists(st.one_of(
    st.tuples(st.just("store"), _hashes),
    st.tuples(st.just("touch"), _hashes),
    st.tuples(st.just("match"), _hashes),
    st.tuples(st.just("release"), st.integers(0, 100)),
    st.tuples(st.just("lead"), st.sampled_from(["lru", "lfu"])),
    st.tuples(st.just("reset"), _hashes),
), max_size=80)


def _slots_of(pool):
    """(hash, slot, count) of each registered block, in slot order."""
    count = pool._store.count
    return [(pool.lookup(h).sequence_hash, pool.lookup(h).block_id, count[pool.lookup(h).block_id])
            for h in pool.hashes()]


@settings(max_examples=200, deadline=None)
@given(ops=_ops, capacity=st.integers(1, 8))
def test_adaptive_evicts_as_two_separate_orders(ops, capacity):
    leader = _Leader()
    pools = [BlockPool("G1", capacity, 1, eviction=order)
             for order in (DuelingEviction(capacity, leader), _TwoOrders(capacity, leader))]
    held = [[], []]
    for op, arg in ops:
        if op == "lead":
            leader.eviction = arg
            continue
        for pool, handles in zip(pools, held):
            if op == "store":
                new = list(dict.fromkeys(h for h in arg if h not in pool))
                if new and pool.can_allocate(len(new)):
                    handle = pool.allocate(len(new))
                    handle.apply_token_blocks([BlockRecord(h, h, None, 1) for h in new])
                    pool.release(pool.register(handle))
            elif op == "touch":
                pool.touch(arg)
            elif op == "match":
                handles.append(pool.match(arg))
            elif op == "release" and handles:
                pool.release(handles.pop(arg % len(handles)))
            elif op == "reset":
                pool.reset_blocks(arg)
        ours, ref = pools
        ours.check_invariants()
        assert _slots_of(ours) == _slots_of(ref)
        assert ours.evictions == ref.evictions


def test_adaptive_recency_is_release_order_whatever_the_insert_order():
    leader = _Leader()
    order = DuelingEviction(8, leader)
    store = SlotStore(8, 1)
    order.attach(store)
    ticks = (5, 3, 9, 1, 7, 2)
    for slot, tick in enumerate(ticks):
        store.tick[slot] = tick
        store.seq[slot] = 100 + slot
        order.registered(slot)
    order.insert_many([0, 1, 2])
    order.insert_many([3, 4, 5])               # older ticks than those already in
    order.insert(0)                            # a re-insert at the same tick
    assert order.members() == set(range(6))
    assert [ticks[s] for s in order.victims(4)] == [1, 2, 3, 5]
    leader.eviction = "lfu"
    assert [ticks[s] for s in order.victims(4)] == [7, 9]
    assert len(order) == 0 and order.members() == set()
