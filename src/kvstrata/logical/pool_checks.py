"""Consistency checks of a :class:`~kvstrata.logical.pool.BlockPool` (tests and debugging).

Kept apart from the pool because they walk every slot (O(capacity), more for leaf-first
pools): nothing on a hot path calls them.
"""

from __future__ import annotations

from . import slots


def check_pool_invariants(pool) -> None:
    """Assert ``pool``'s bookkeeping is consistent; raises ``AssertionError`` naming the
    first inconsistency. ``pool`` is a :class:`~kvstrata.logical.pool.BlockPool` (not
    imported here: the pool imports this module, and reads of its internals are this
    module's whole job)."""
    store = pool._store
    state, refs, seq, up, kids = store.state, store.refs, store.seq, store.up, store.kids
    free = set(pool._free)
    assert len(free) == len(pool._free), "a slot is on the free list twice"
    assert pool._made <= pool.capacity, "more slots made than the capacity"
    assert all(slot < pool._made for slot in free), "a never-made slot is on the free list"
    inactive = 0
    registered = []
    for slot in range(pool._made):
        assert refs[slot] >= 0, f"block {slot} has negative refs"
        if slot in free:
            assert state[slot] == slots.RESET and refs[slot] == 0, (
                f"free block {slot} is in state {state[slot]} with {refs[slot]} refs"
            )
        elif state[slot] == slots.REGISTERED:
            assert pool._index.get(seq[slot]) == slot, (
                f"registered block {slot} not indexed by its hash"
            )
            registered.append(slot)
            inactive += refs[slot] == 0
        else:
            assert refs[slot] > 0, f"unregistered block {slot} leaked"
    for slot in range(pool._made, pool.capacity):
        if slot >= pool._made + 64:
            break                      # never-made slots are zeros: a sample will do
        assert state[slot] == slots.RESET and refs[slot] == 0, f"unmade slot {slot} is in use"
    assert inactive == pool._inactive, f"inactive count {pool._inactive} != {inactive}"
    assert len(pool._index) == len(registered), (
        f"the index holds {len(pool._index)} hashes for {len(registered)} registered blocks")
    stamps = [store.born[slot] for slot in registered]
    assert len(set(stamps)) == len(stamps) and all(b < pool._born for b in stamps), (
        "registration stamps drifted (two alike, or one not yet handed out)")
    if pool._leaf_first:
        counted: dict[int, int] = {}
        for slot in registered:
            if up[slot]:
                counted[up[slot] - 1] = counted.get(up[slot] - 1, 0) + 1
        for slot in registered:
            assert counted.get(slot, 0) == kids[slot], f"block {slot} child count drifted"
        assert pool._active_registered == {s for s in registered if refs[s]}, (
            "the set of registered blocks in use drifted")
        flags, parent = store.flags, store.parent
        by_parent = pool._waiting_children()
        waiting = {slot: h for h, children in by_parent.items() for slot in children}
        assert sum(map(len, by_parent.values())) == len(waiting), "a block waits twice"
        assert set(pool._waiting_more) <= set(by_parent) and all(pool._waiting_more.values()), (
            "more blocks wait for a parent than the first one, or none")
        for slot in registered:
            if up[slot] or not flags[slot] & slots.HAS_PARENT or parent[slot] == seq[slot]:
                assert slot not in waiting, f"block {slot} waits though it needs no parent"
                continue
            held = pool._index.get(parent[slot])
            if held is None:
                assert waiting.get(slot) == parent[slot], (
                    f"block {slot} does not wait for its parent, which is not held")
            else:
                # its parent is held: unlinked only where linking would close a loop
                assert slot not in waiting and pool._descends(held, slot), (
                    f"block {slot} is not linked to its parent {held}, held here")
        assert set(waiting) <= set(registered), "a slot not registered waits for a parent"
    expected_evictable = {
        s for s in registered if refs[s] == 0 and not (pool._leaf_first and kids[s])
    }
    members = pool.eviction.members()
    assert members == expected_evictable and len(pool.eviction) == len(members), (
        f"eviction order holds {sorted(members)[:8]}..., expected {sorted(expected_evictable)[:8]}..."
    )
