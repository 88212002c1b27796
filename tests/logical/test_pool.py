import gc

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.logical.block import BlockState, BlockStateError
from kvstrata.logical.handles import HandleReleasedError
from kvstrata.logical.policy import make_eviction
from kvstrata.logical.pool import BlockPool, ForeignHandleError, PoolExhaustedError
from kvstrata.logical.registry import BlockRecord, BlockRegistry
from kvstrata.tokens import chain_hashes
from native_paths import NATIVE_BUILT, restore_native, set_native


def chain(n, start=1):
    """Records of a chain of n blocks whose local hashes are start, start+1, ..."""
    seqs = chain_hashes(range(start, start + n))
    parents = [None, *seqs[:-1]]
    return [BlockRecord(s, l, p, 4) for s, l, p in zip(seqs, range(start, start + n), parents)]


def store(pool, records, priority=0):
    """Allocate, fill, register and release; returns the hashes."""
    handle = pool.allocate(len(records))
    handle.apply_token_blocks(records)
    pool.register(handle, priority=priority).release()
    return [r.sequence_hash for r in records]


def test_allocate_is_all_or_nothing():
    pool = BlockPool("G1", 4, 4)
    held = pool.allocate(3)
    with pytest.raises(PoolExhaustedError) as err:
        pool.allocate(2)
    assert err.value.available == 1
    assert pool.status().reset == 1 and pool.status().active == 3
    held.release()
    assert pool.status().reset == 4
    pool.check_invariants()


def test_register_dedups_and_returns_the_slot():
    pool = BlockPool("G1", 4, 4)
    recs = chain(2)
    store(pool, recs)
    again = pool.allocate(2)
    again.apply_token_blocks(recs)
    ids_before = {pool.lookup(r.sequence_hash).block_id for r in recs}
    handle = pool.register(again)
    assert set(handle.block_ids) == ids_before
    assert pool.status().reset == 2  # the duplicate slots went back
    assert again.released
    handle.release()
    pool.check_invariants()


def test_register_requires_complete_and_changes_nothing():
    pool = BlockPool("G1", 4, 4)
    handle = pool.allocate(2)
    handle[0].apply_token_block(chain(1)[0])
    with pytest.raises(BlockStateError):
        pool.register(handle)
    assert not handle.released and handle[0].state is BlockState.COMPLETE
    assert len(pool.registry) == 0
    handle.release()
    assert pool.status().reset == 4


def test_match_is_prefix_and_acquires():
    pool = BlockPool("G1", 8, 4)
    hashes = store(pool, chain(4))
    got = pool.match([hashes[0], hashes[1], 12345, hashes[3]])
    assert got.sequence_hashes == hashes[:2]
    assert pool.status().active == 2
    assert pool.match_length(hashes) == 4
    got.release()
    assert pool.status().active == 0 and pool.status().inactive == 4


def test_with_block_releases():
    pool = BlockPool("G1", 4, 4)
    hashes = store(pool, chain(2))
    with pool.match(hashes) as handle:
        assert pool.status().active == 2
    assert handle.released and pool.status().active == 0
    with pytest.raises(HandleReleasedError):
        handle.release()


def test_foreign_handle_rejected():
    a, b = BlockPool("G1", 2, 4), BlockPool("G2", 2, 4)
    handle = a.allocate(1)
    with pytest.raises(ForeignHandleError):
        b.release(handle)
    handle.release()


def test_dropped_handle_is_returned_by_owner_not_gc():
    pool = BlockPool("G1", 4, 4)
    hashes = store(pool, chain(2))
    handle = pool.match(hashes)
    mutable = pool.allocate(2)
    del handle, mutable
    gc.collect()
    # The finalizer only queued the return; the pool applies it on its next call.
    assert pool._inactive == 0
    status = pool.status()
    assert status.active == 0 and status.inactive == 2 and status.reset == 2
    pool.check_invariants()


def test_default_eviction_reset_first_then_priority_then_lru():
    pool = BlockPool("G1", 4, 4)
    low = store(pool, chain(1, start=100), priority=0)
    high = store(pool, chain(1, start=200), priority=5)
    old = store(pool, chain(1, start=300), priority=1)
    pool.allocate(1).release()  # one reset slot remains: taken before any eviction
    assert pool.status().reset == 1
    got = pool.allocate(2)
    # reset slot first, then the lowest priority (low), not the older-but-higher ones.
    assert low[0] not in pool and high[0] in pool and old[0] in pool
    got.release()


def test_default_eviction_leaves_before_prefixes():
    pool = BlockPool("G1", 3, 4, eviction=make_eviction("default", 3))
    hashes = store(pool, chain(3))  # released first to last: the root is least recent
    victims, held = [], []
    for _ in range(3):
        before = pool.registry.hashes_in("G1")
        held.append(pool.allocate(1))
        victims.extend(before - pool.registry.hashes_in("G1"))
    assert victims == [hashes[2], hashes[1], hashes[0]]
    for handle in held:
        handle.release()


def test_lru_eviction_ignores_tree_and_priority():
    pool = BlockPool("G1", 3, 4, eviction=make_eviction("lru", 3))
    hashes = store(pool, chain(3), priority=9)
    pool.allocate(1).release()
    assert hashes[0] not in pool  # plain LRU: the root was released first


def test_leaf_first_never_evicts_prefix_of_block_in_use():
    pool = BlockPool("G1", 4, 4)
    hashes = store(pool, chain(3))
    held = pool.match(hashes)  # whole chain in use
    held_leaf = pool.match(hashes[:3])
    held.release()
    # Chain is inactive except through held_leaf; only the one reset slot is available.
    assert not pool.can_allocate(2)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)
    held_leaf.release()
    assert pool.can_allocate(4)
    pool.allocate(4).release()
    assert len(pool.registry) == 0


def test_cascade_eviction_reaches_parents():
    pool = BlockPool("G1", 3, 4)
    store(pool, chain(3))
    # Only the leaf is evictable now, but allocate(3) can cascade up the chain.
    assert pool.can_allocate(3)
    pool.allocate(3).release()
    assert pool.status().reset == 3 and pool.evictions == 3


def test_touch_refreshes_recency():
    pool = BlockPool("G1", 2, 4, eviction=make_eviction("lru", 2))
    a = store(pool, chain(1, start=1))
    b = store(pool, chain(1, start=2))
    assert pool.touch(a + [999]) == 1
    pool.allocate(1).release()
    assert a[0] in pool and b[0] not in pool


def test_reset_blocks_and_clear_emit_events():
    registry = BlockRegistry()
    events = []

    class Obs:
        def on_tier_stored(self, tier, records):
            events.append(("stored", tier, len(records)))

        def on_tier_removed(self, tier, hashes):
            events.append(("removed", tier, len(hashes)))

        def on_tier_cleared(self, tier):
            events.append(("cleared", tier))

        def on_stored(self, records): pass

        def on_removed(self, hashes): pass

    registry.add_observer(Obs())
    pool = BlockPool("G1", 8, 4, registry=registry)
    hashes = store(pool, chain(3))
    held = pool.match(hashes[:1])
    assert pool.reset_blocks([hashes[0], hashes[2]]) == [hashes[2]]  # root in use / has child
    held.release()
    assert pool.clear() == 2
    assert events == [("stored", "G1", 3), ("removed", "G1", 1), ("cleared", "G1")]
    assert pool.status().reset == 8 and len(registry) == 0


def test_registry_spans_tiers():
    registry = BlockRegistry()
    g1 = BlockPool("G1", 2, 4, registry=registry)
    g2 = BlockPool("G2", 4, 4, registry=registry)
    recs = chain(2)
    store(g1, recs)
    store(g2, recs)
    assert registry.tiers_of(recs[0].sequence_hash) == {"G1", "G2"}
    g1.clear()
    assert registry.tiers_of(recs[0].sequence_hash) == {"G2"}


# -- property-based: random operation sequences keep every invariant -------------------------


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / register / match / touch / release / reset sequences."""

    def __init__(self):
        super().__init__()
        self.policy = "default"
        self.pool = None
        self.handles = []
        self.universe = chain(12) + chain(6, start=50)

    @precondition(lambda self: self.pool is None)
    @rule(capacity=st.integers(1, 10), policy=st.sampled_from(["default", "lru", "lfu", "adaptive"]))
    def create(self, capacity, policy):
        self.pool = BlockPool("G1", capacity, 4, eviction=make_eviction(policy, capacity))

    @precondition(lambda self: self.pool is not None)
    @rule(start=st.integers(0, 17), length=st.integers(1, 5), priority=st.integers(0, 2))
    def allocate_and_register(self, start, length, priority):
        records = self.universe[start : start + length]
        if not self.pool.can_allocate(len(records)):
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(len(records))
            return
        handle = self.pool.allocate(len(records))
        handle.apply_token_blocks(records)
        registered = self.pool.register(handle, priority=priority)
        assert registered.sequence_hashes == [r.sequence_hash for r in records]
        self.handles.append(registered)

    @precondition(lambda self: self.pool is not None)
    @rule(start=st.integers(0, 17), length=st.integers(1, 5))
    def register_children_first(self, start, length):
        # a batch in reverse chain order: each parent registered after its child (a
        # leaf-first pool links them all the same; check_invariants says so)
        records = self.universe[start : start + length][::-1]
        if not self.pool.can_allocate(len(records)):
            return
        handle = self.pool.allocate(len(records))
        handle.apply_token_blocks(records)
        self.handles.append(self.pool.register(handle))

    @precondition(lambda self: self.pool is not None)
    @rule()
    def clear(self):
        self.pool.clear()

    @precondition(lambda self: self.pool is not None)
    @rule(count=st.integers(0, 3))
    def allocate_mutable(self, count):
        if self.pool.can_allocate(count):
            self.handles.append(self.pool.allocate(count))

    @precondition(lambda self: self.pool is not None)
    @rule(start=st.integers(0, 17), length=st.integers(1, 8))
    def match(self, start, length):
        hashes = [r.sequence_hash for r in self.universe[start : start + length]]
        expected = self.pool.match_length(hashes)
        handle = self.pool.match(hashes)
        assert handle.sequence_hashes == hashes[:expected]  # a prefix, exactly
        self.handles.append(handle)

    @precondition(lambda self: self.pool is not None)
    @rule(start=st.integers(0, 17), length=st.integers(1, 8))
    def touch(self, start, length):
        self.pool.touch([r.sequence_hash for r in self.universe[start : start + length]])

    @precondition(lambda self: self.pool is not None and self.handles)
    @rule(index=st.integers(0, 100))
    def release(self, index):
        self.handles.pop(index % len(self.handles)).release()

    @precondition(lambda self: self.pool is not None and self.handles)
    @rule(index=st.integers(0, 100))
    def drop_without_release(self, index):
        self.handles.pop(index % len(self.handles))
        gc.collect()

    @precondition(lambda self: self.pool is not None and self.pool.eviction.name == "adaptive")
    @rule(start=st.integers(0, 17), length=st.integers(1, 8))
    def observe_request(self, start, length):
        # Feed the adaptive policy's duel so its leader can switch to the LFU order.
        self.pool.eviction._duel.observe_request(
            [r.sequence_hash for r in self.universe[start : start + length]]
        )

    @precondition(lambda self: self.pool is not None)
    @rule(start=st.integers(0, 17))
    def reset_blocks(self, start):
        self.pool.reset_blocks([r.sequence_hash for r in self.universe[start : start + 3]])

    @invariant()
    def consistent(self):
        if self.pool is None:
            return
        self.pool.check_invariants()
        status = self.pool.status()
        assert status.active + status.inactive + status.reset == self.pool.capacity
        held = {b.block_id for h in self.handles for b in h.blocks}
        free = set(self.pool._free)
        assert not held & free, "a block is both free and in use"
        # A registered hash maps to exactly one live block in this pool.
        hashes = self.pool.hashes()
        assert len(hashes) == len(set(hashes))
        assert self.pool.registry.hashes_in("G1") == set(hashes)

    def teardown(self):
        for handle in self.handles:
            handle.release()
        if self.pool is not None:
            status = self.pool.status()
            assert status.active == 0
            self.pool.check_invariants()


_MACHINE_SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None)


class NativePoolMachine(PoolMachine):
    """The machine on the native block loops and hashing (tests/logical/native_paths.py)."""

    def __init__(self):
        self._before = set_native(True)
        super().__init__()

    def teardown(self):
        try:
            super().teardown()
        finally:
            restore_native(self._before)


class PythonPoolMachine(NativePoolMachine):
    def __init__(self):
        self._before = set_native(False)
        PoolMachine.__init__(self)


TestPythonPoolMachine = PythonPoolMachine.TestCase
TestPythonPoolMachine.settings = _MACHINE_SETTINGS
TestNativePoolMachine = pytest.mark.skipif(not NATIVE_BUILT, reason="native extensions not built")(
    NativePoolMachine.TestCase)
TestNativePoolMachine.settings = _MACHINE_SETTINGS


def test_leaf_in_use_pins_its_idle_prefix():
    pool = BlockPool("G1", 4, 4)
    hashes = store(pool, chain(3))
    leaf = pool.acquire(hashes[2:])  # only the leaf is in use; its two ancestors are idle
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)
    got = pool.allocate(1)  # the free slot, not an ancestor of the leaf
    assert all(h in pool for h in hashes)
    got.release()
    leaf.release()
    pool.check_invariants()


def test_default_order_is_least_recently_released_within_a_priority():
    pool = BlockPool("G1", 3, 4)
    a = store(pool, chain(1, start=10))
    b = store(pool, chain(1, start=20))
    c = store(pool, chain(1, start=30))
    pool.touch(a)  # a becomes the most recent
    held = pool.allocate(2)
    assert a[0] in pool and b[0] not in pool and c[0] not in pool
    held.release()


def test_can_allocate_agrees_with_allocate_after_dropped_handles():
    pool = BlockPool("G1", 4, 4)
    dropped = pool.allocate(4)
    del dropped  # the finalizer queues the slots; nothing has taken them back yet
    assert pool.can_allocate(4)
    pool.allocate(4).release()


def test_same_hash_twice_in_one_register_batch():
    pool = BlockPool("G1", 4, 4)
    rec = chain(1)[0]
    handle = pool.allocate(2)
    handle.apply_token_blocks([rec, rec])
    registered = pool.register(handle)
    assert registered.block_ids[0] == registered.block_ids[1]
    assert pool.status().reset == 3 and pool.lookup(rec.sequence_hash).ref_count == 2
    registered.release()
    pool.check_invariants()


def test_failing_observer_does_not_corrupt_the_pool():
    class Broken:
        def __getattr__(self, name):
            def hook(*args):
                raise RuntimeError("sink down")
            return hook

    registry = BlockRegistry()
    registry.add_observer(Broken())
    pool = BlockPool("G1", 2, 4, registry=registry)
    hashes = store(pool, chain(2))
    pool.allocate(2).release()  # evicts both: record_removed raises inside the observer
    assert registry.observer_errors >= 2
    assert pool.status().reset == 2 and not any(h in pool for h in hashes)
    pool.check_invariants()


def test_reset_blocks_drops_a_chain_listed_children_first():
    pool = BlockPool("G1", 4, 4)
    hashes = store(pool, chain(3))
    assert pool.reset_blocks(hashes) == [hashes[2]]  # root first: only the leaf can go
    assert pool.reset_blocks(list(reversed(hashes[:2]))) == [hashes[1], hashes[0]]
    assert pool.status().reset == 4


def test_acquire_holds_without_counting_a_hit():
    pool = BlockPool("G1", 2, 1, eviction=make_eviction("lfu", 2))
    recs = [BlockRecord(7, 7, None, 1)]
    handle = pool.allocate(1)
    handle.apply_token_blocks(recs)
    pool.register(handle).release()
    held = pool.acquire([7, 99])
    assert held.sequence_hashes == [7] and pool.lookup(7).policy_state == 1
    held.release()


@pytest.mark.parametrize("policy", ["lru", "default", "lfu", "adaptive"])
def test_restore_places_recovered_blocks_in_their_slots(policy):
    from kvstrata.logical.registry import RegistryObserver

    class Seen(RegistryObserver):
        stored = []

        def on_tier_stored(self, tier, records):
            self.stored.extend(records)

    registry = BlockRegistry()
    seen = Seen()
    registry.add_observer(seen)
    pool = BlockPool("G3", 8, 4, eviction=make_eviction(policy, 8), registry=registry)
    records = chain(3)
    assert pool.restore([(5, records[0]), (2, records[1]), (6, records[2])]) == 3
    pool.check_invariants()
    assert [pool.lookup(r.sequence_hash).block_id for r in records] == [5, 2, 6]
    assert pool.match_length([r.sequence_hash for r in records]) == 3
    assert [r.sequence_hash for r in seen.stored] == [r.sequence_hash for r in records]
    status = pool.status()
    assert (status.inactive, status.reset) == (3, 5)
    fresh = pool.allocate(5)                      # the free slots, no eviction
    assert sorted(fresh.block_ids) == [0, 1, 3, 4, 7] and pool.evictions == 0
    fresh.release()
    victims = pool.allocate(6)                    # now one restored block must go
    assert pool.evictions == 1
    victims.release()
    pool.check_invariants()


def test_restore_refuses_bad_entries_and_skips_reused_slots():
    pool = BlockPool("G3", 4, 4)
    a, b = chain(2)
    with pytest.raises(ValueError, match="twice"):
        pool.restore([(0, a), (0, b)])
    with pytest.raises(ValueError, match="out of range"):
        pool.restore([(4, a)])
    with pytest.raises(ValueError, match="tokens"):
        pool.restore([(1, BlockRecord(a.sequence_hash, a.local_hash, None, 8))])
    assert pool.status().reset == 4 and a.sequence_hash not in pool
    store(pool, [a])                              # slot 0 holds a now
    held = pool.allocate(1)                       # slot 1 in use
    c, d = chain(2, start=50)
    assert pool.restore([(0, b), (1, c), (3, a), (2, d)]) == 1   # only d: slot 2 was free
    assert pool.lookup(d.sequence_hash).block_id == 2 and b.sequence_hash not in pool
    assert pool.lookup(a.sequence_hash).block_id == 0
    held.release()
    pool.check_invariants()
    assert sorted(pool.allocate(2).block_ids) == [1, 3]


class _Removed:
    """A registry observer keeping the hashes of on_removed, in order."""

    def __init__(self):
        self.gone = []

    def on_tier_stored(self, tier, records): pass
    def on_tier_removed(self, tier, hashes): pass
    def on_tier_cleared(self, tier): pass
    def on_stored(self, records): pass

    def on_removed(self, hashes):
        self.gone.append(list(hashes))


@pytest.mark.parametrize("policy", ["lru", "default", "lfu", "adaptive"])
@pytest.mark.parametrize("near_wrap", [False, True])
def test_clear_announces_and_frees_in_registration_order_not_slot_order(policy, near_wrap):
    """The pool once kept its blocks in a dict (hash -> block): clear() announced them, and
    put their slots on the free stack, in registration order. Slot order differs once
    slots are reused, and so did the events and later slot ids; also across the
    registration stamps' 32-bit renumbering (``near_wrap``)."""
    registry, seen = BlockRegistry(), _Removed()
    registry.add_observer(seen)
    pool = BlockPool("G2", 4, 4, eviction=make_eviction(policy, 4), registry=registry)
    if near_wrap:
        pool._born = 2**32 - 3                     # the next batch renumbers the stamps
    handle = pool.allocate(4)                      # slots 0 1 2 3
    recs = [BlockRecord(100 + i, 100 + i, None, 4) for i in range(4)]
    handle.apply_token_blocks(recs)
    pool.register(handle).release()
    for h in (101, 102):                           # free slots 1 and 2 ...
        assert pool.reset_blocks([h])
    for h in (202, 201):                           # ... and register in them again
        store(pool, [BlockRecord(h, h, None, 4)])  # 202 takes slot 2, 201 slot 1
    assert pool.lookup(202).block_id == 2 and pool.lookup(201).block_id == 1
    assert pool.hashes() == [100, 103, 202, 201]
    assert pool.clear() == 4
    assert seen.gone[-1] == [100, 103, 202, 201]   # slot order would be 100, 201, 202, 103
    again = pool.allocate(4)
    assert again.block_ids == [1, 2, 3, 0]         # the free stack, the last one first
    pool.release(again)
    pool.check_invariants()
    assert pool._born < 2**32


@pytest.mark.parametrize("born", [-1, 2**32 - 1])
def test_bulk_registration_stamps_must_fit_32_bits(born):
    pool = BlockPool("G1", 4, 4)
    handle = pool.allocate(2)
    handle.apply_token_blocks([BlockRecord(7, 7, None, 4), BlockRecord(8, 8, None, 4)])
    with pytest.raises(ValueError, match="32 bits"):
        pool._ops.register_new(handle._ids, None, 0, False, born)
    assert len(pool._index) == 0 and set(pool._store.pending) == set(handle._ids)
