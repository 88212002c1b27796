"""The slot store's two sides: the native HashIndex against a dict, and pools on the native
slot loops against pools on the Python ones (every column, every event, every answer)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvstrata.logical.policy import make_tier_policies
from kvstrata.logical.pool import BlockPool, PoolExhaustedError
from kvstrata.placement.offload import allocate_up_to
from kvstrata.logical.registry import BlockRecord, BlockRegistry, RegistryObserver
from kvstrata.tokens import chain_hashes
from native_paths import NATIVE_BUILT, restore_native, set_native

needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="native extensions not built")

_keys = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))


@needs_native
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "pop", "del", "get"]), _keys,
                              st.integers(0, 2**31 - 1)), max_size=300))
def test_hash_index_is_a_dict_of_u64_keys(ops):
    from kvstrata.logical._slots import HashIndex

    table, model = HashIndex(), {}
    for op, key, value in ops:
        if op == "set":
            table[key] = value
            model[key] = value
        elif op == "pop":
            assert table.pop(key, None) == model.pop(key, None)
        elif op == "del":
            if key in model:
                del table[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]
        assert table.get(key) == model.get(key) and (key in table) == (key in model)
        assert len(table) == len(model)
    assert sorted(table.items()) == sorted(model.items())


@needs_native
@pytest.mark.parametrize("key, value, error", [(-1, 1, ValueError), (2**64, 1, ValueError),
                                               ("a", 1, ValueError), (1, -1, ValueError),
                                               (1, 2**31, ValueError), (1, "x", TypeError)])
def test_hash_index_refuses_what_it_cannot_hold_and_changes_nothing(key, value, error):
    from kvstrata.logical._slots import HashIndex

    table = HashIndex()
    table[5] = 7
    with pytest.raises(error):
        table[key] = value
    assert table.items() == [(5, 7)] and table.get(key) is None and key not in table


class _Events(RegistryObserver):
    def __init__(self):
        self.seen = []

    def on_tier_stored(self, tier, records):
        self.seen.append(("stored", [r.sequence_hash for r in records]))

    def on_tier_removed(self, tier, hashes):
        self.seen.append(("removed", list(hashes)))

    def on_tier_cleared(self, tier):
        self.seen.append(("cleared",))


def _pool(native, capacity, policy):
    before = set_native(native)
    try:
        registry = BlockRegistry()
        events = _Events()
        registry.add_observer(events)
        policies = make_tier_policies(policy, "always", capacity)
        pool = BlockPool("G1", capacity, 4, eviction=policies.eviction, registry=registry)
        assert pool._store.native == native
        return pool, events, policies.observe_request
    finally:
        restore_native(before)


_universe = [BlockRecord(s, i, p, 4) for i, (s, p) in enumerate(
    zip(chain_hashes(range(1, 13)), [None, *chain_hashes(range(1, 12))]))]
_universe += [BlockRecord(100 + i, 100 + i, None, 4) for i in range(6)]

_steps = st.lists(st.tuples(
    st.sampled_from(["store", "match", "touch", "acquire", "release", "reset", "alloc",
                     "clear", "observe", "restore", "drop", "learn"]),
    st.integers(0, 17), st.integers(1, 6), st.integers(-1, 2)), max_size=60)


def _apply(pool, observe, handles, step):
    op, start, length, extra = step
    records = _universe[start:start + length]
    hashes = [r.sequence_hash for r in records]
    try:
        if op == "store":
            handle = pool.allocate(len(records))
            handle.apply_token_blocks(records)
            got = pool.register(handle, priority=extra)
            handles.append(got)
            return got.block_ids
        if op == "match":
            handles.append(pool.match(hashes))
            return handles[-1].block_ids
        if op == "acquire":
            handles.append(pool.acquire(hashes))
            return handles[-1].block_ids
        if op == "touch":
            return pool.touch(hashes)
        if op == "release" and handles:
            handles.pop((start + extra) % len(handles)).release()
        if op == "reset":
            return pool.reset_blocks(hashes)
        if op == "alloc":
            handles.append(pool.allocate(extra))
            return handles[-1].block_ids
        if op == "clear" and extra == 0:
            return pool.clear()
        if op == "observe" and observe is not None:
            observe(hashes)
        if op == "restore":          # a durable tier's recovery: (slot, record), oldest first
            slots_ = [(start + 3 * i + extra) % pool.capacity for i in range(len(records))]
            entries = list(dict(zip(slots_, records)).items())
            return pool.restore(entries)
        if op == "drop":
            return pool.drop_with_descendants(hashes[extra % len(hashes):][:2])
        if op == "learn":            # a G4 catalog learning blocks: as Planner.learn
            new = [r for r in records if r.sequence_hash not in pool]
            handle = allocate_up_to(pool, len(new)) if new else None
            if handle is not None:
                handle.apply_token_blocks(new[:len(handle.block_ids)])
                held = pool.register(handle)
                ids = held.block_ids
                pool.release(held)
                return ids
    except PoolExhaustedError as err:
        return ("exhausted", err.available)
    except ValueError as err:
        return ("refused", str(err))
    return None


@needs_native
@settings(max_examples=300, deadline=None)
@given(steps=_steps, capacity=st.integers(1, 9),
       policy=st.sampled_from(["lru", "default", "lfu", "adaptive"]))
def test_native_and_python_pools_agree_on_every_column_and_event(steps, capacity, policy):
    """Under pressure (at most 9 slots for 18 blocks), with priorities (-1 .. 2), clear(),
    restore() (a durable tier's recovery), a catalog's learning and leaf-first drops."""
    native, native_events, native_observe = _pool(True, capacity, policy)
    python, python_events, python_observe = _pool(False, capacity, policy)
    held = ([], [])
    for step in steps:
        answers = [_apply(native, native_observe, held[0], step),
                   _apply(python, python_observe, held[1], step)]
        assert answers[0] == answers[1], step
        for a, b in zip(native._store.arrays, python._store.arrays):
            assert np.array_equal(a, b), step
        assert native._store.pending.keys() == python._store.pending.keys()
        assert native_events.seen == python_events.seen
        assert native.status() == python.status()
    native.check_invariants()
    python.check_invariants()
