"""Leaf-first pools link a block to its parent whichever of them is registered first.

A parent registered after its child (an onboard whose copies finish out of order, a prefix
loaded again after its tail) adopts the child: it is not evictable while the child is held
(docs/policies.md, ``default``: "a block with registered children in the pool is not
evictable"). Every path that registers (bulk, one by one, restore) and every one that removes
(eviction, reset, clear, drop) keeps the pool's index of children waiting for their parent in
step (checked by ``check_invariants``). Runs on both paths of the block loops (conftest.py).
"""

import pytest

from kvstrata.logical.policy import make_eviction
from kvstrata.logical.pool import BlockPool
from kvstrata.logical.registry import BlockRecord
from kvstrata.tokens import chain_hashes


def chain(n, start=1):
    seqs = chain_hashes(range(start, start + n))
    parents = [None, *seqs[:-1]]
    return [BlockRecord(s, l, p, 4) for s, l, p in zip(seqs, range(start, start + n), parents)]


def pool_of(capacity, keep_tokens=False):
    return BlockPool("G1", capacity, 4, eviction=make_eviction("default", capacity),
                     keep_tokens=keep_tokens)


def store(pool, records):
    handle = pool.allocate(len(records))
    handle.apply_token_blocks(records)
    pool.register(handle).release()
    pool.check_invariants()
    return [r.sequence_hash for r in records]


@pytest.mark.parametrize("keep_tokens", [False, True], ids=["bulk", "one-by-one"])
def test_a_parent_registered_after_its_child_is_not_evicted_before_it(keep_tokens):
    """The reviewer's repro_parent_after_child.py, on the pool: the child (A1) comes first,
    its prefix (A0) later; one slot wanted: the leaf goes, not its prefix."""
    a0, a1 = chain(2)
    pool = pool_of(2, keep_tokens)
    store(pool, [a1])
    store(pool, [a0])
    assert pool._store.kids[pool._index[a0.sequence_hash]] == 1
    pool.allocate(1).release()
    assert a0.sequence_hash in pool and a1.sequence_hash not in pool
    pool.check_invariants()


@pytest.mark.parametrize("keep_tokens", [False, True], ids=["bulk", "one-by-one"])
def test_a_parent_later_in_the_same_batch_is_linked(keep_tokens):
    records = chain(4)
    pool = pool_of(4, keep_tokens)
    hashes = store(pool, records[::-1])             # leaf first, root last
    kids = pool._store.kids
    assert [kids[pool._index[h]] for h in hashes] == [0, 1, 1, 1]
    pool.allocate(1).release()                      # only the leaf may go
    assert hashes[0] not in pool and all(h in pool for h in hashes[1:])
    pool.check_invariants()


def test_several_children_waiting_for_one_parent():
    root = BlockRecord(10, 10, None, 4)
    kids = [BlockRecord(20 + i, 20 + i, 10, 4) for i in range(3)]
    pool = pool_of(4)
    store(pool, kids[:2])
    store(pool, [kids[2]])
    waiting = pool._waiting_children()
    assert list(waiting) == [10] and sorted(waiting[10]) == sorted(
        pool._index[k.sequence_hash] for k in kids)
    store(pool, [root])
    assert pool._waiting_children() == {} and pool._store.kids[pool._index[10]] == 3
    slots_of_kids = {pool._index[k.sequence_hash] for k in kids}
    assert set(pool.allocate(3).block_ids) == slots_of_kids     # the leaves, not the root
    assert 10 in pool
    pool.check_invariants()


@pytest.mark.parametrize("leaving", [(20,), (21,), (22,), (20, 21), (22, 20), (20, 21, 22)])
def test_siblings_waiting_for_one_parent_leave_in_any_order(leaving):
    """Several blocks wait for one absent parent (one in the pool's table, the others
    beside it): any of them leaving keeps the rest waiting, and the parent adopts exactly
    those left. The table is the index's kind (a native one holds no Python object)."""
    root = BlockRecord(10, 10, None, 4)
    kids = {h: BlockRecord(h, h, 10, 4) for h in (20, 21, 22)}
    pool = pool_of(5)
    assert type(pool._waiting) is type(pool._index)
    for h in (20, 21, 22):
        store(pool, [kids[h]])
    assert pool.reset_blocks(list(leaving)) == list(leaving)
    pool.check_invariants()
    left = sorted(set(kids) - set(leaving))
    assert sorted(pool._waiting_children().get(10, [])) == sorted(pool._index[h] for h in left)
    store(pool, [root])
    assert pool._waiting_children() == {} and pool._store.kids[pool._index[10]] == len(left)
    pool.check_invariants()


def _leave_by(how, pool, hashes):
    if how == "evict":
        pool.allocate(pool.capacity).release()
    elif how == "reset":
        assert pool.reset_blocks(hashes) == hashes
    elif how == "clear":
        pool.clear()
    elif how == "clear-with-a-block-in-use":
        other = store(pool, [BlockRecord(99, 99, None, 4)])
        held = pool.match(other)
        pool.clear()
        held.release()
    elif how == "drop":
        pool.drop_with_descendants(hashes)


@pytest.mark.parametrize("how", ["evict", "reset", "clear", "clear-with-a-block-in-use",
                                 "drop"])
def test_a_waiting_child_that_leaves_is_forgotten(how):
    """A child removed before its parent came waits no more: the parent, registered later
    (in the child's old slot, say), adopts nothing."""
    a0, a1 = chain(2)
    pool = pool_of(3)
    store(pool, [a1])
    assert pool._waiting_children() == {a0.sequence_hash: [pool._index[a1.sequence_hash]]}
    _leave_by(how, pool, [a1.sequence_hash])
    assert a1.sequence_hash not in pool and pool._waiting_children() == {}
    pool.check_invariants()
    store(pool, [a0])
    assert pool._store.kids[pool._index[a0.sequence_hash]] == 0
    pool.check_invariants()
    pool.allocate(pool.capacity).release()          # the parent is evictable: nothing pins it
    pool.check_invariants()


def test_a_restored_parent_adopts_children_registered_before_it():
    a0, a1, a2 = chain(3)
    pool = pool_of(4)
    store(pool, [a2])
    assert pool.restore([(3, a0), (2, a1)]) == 2    # the prefix, recovered (oldest first)
    kids = pool._store.kids
    assert [kids[pool._index[r.sequence_hash]] for r in (a0, a1, a2)] == [1, 1, 0]
    pool.check_invariants()
    pool.allocate(2).release()                      # a free slot and the leaf
    assert a0.sequence_hash in pool and a1.sequence_hash in pool
    pool.check_invariants()


def test_adoption_never_closes_a_loop():
    """Hashes come from outside: two blocks naming each other as parents are both kept
    evictable (no loop of links that eviction could never reach)."""
    x = BlockRecord(1, 1, 2, 4)
    y = BlockRecord(2, 2, 1, 4)
    for batches in ([[x], [y]], [[x, y]], [[y, x]]):
        for keep_tokens in (False, True):
            pool = pool_of(2, keep_tokens)
            for batch in batches:
                store(pool, batch)
            pool.allocate(2).release()              # both can go
            assert len(pool.hashes()) == 0
            pool.check_invariants()


def test_a_held_parent_registered_late_pins_nothing_it_should_not():
    """Linking a late parent changes what eviction can reach as the tree says: a child in
    use pins its (late) prefix."""
    a0, a1 = chain(2)
    pool = pool_of(3)
    store(pool, [a1])
    store(pool, [a0])
    held = pool.match([a0.sequence_hash, a1.sequence_hash])
    held.release()
    leaf = pool.acquire([a1.sequence_hash])
    assert pool.allocatable() == 1                  # the free slot; a0 is pinned by a1
    assert pool.reachable([a0.sequence_hash]) == [False]
    leaf.release()
    assert pool.allocatable() == 3
    pool.check_invariants()
