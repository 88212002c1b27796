"""The slot store's loops against hostile input: every index taken from Python (ids, list
ids, a queue's head, the hash index's values, the links in the columns) is checked before
it is followed, the columns a native store is made of are checked, and a loop that fails
leaves the index as it was. Run on both paths (conftest.py); the native-only cases would
crash the interpreter, not fail, if a check were missing."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvstrata.logical import slots
from kvstrata.logical.slots import SlotStore
from kvstrata.types import BlockRecord


def _native_only(store):
    if not store.native:
        pytest.skip("a check of the native loops")


def _complete(store, ids, base=100):
    """Make ``ids`` Complete blocks with hashes base + i (as ``apply`` would)."""
    records = [BlockRecord(base + i, base + i, None, store.block_size) for i in range(len(ids))]
    assert store.ops.apply(list(ids), records, store.block_size) == len(ids)
    return records


@pytest.mark.parametrize("head", [-1, -2, -10**6])
def test_a_recency_queue_head_below_zero_is_refused(head):
    store = SlotStore(4, 4)
    store.ops.push_back(store.new_list(), [0, 1])
    recent = [store.tick[0], 0, store.tick[1], 1]
    with pytest.raises(IndexError):
        store.ops.recent_take(recent, head, 1)
    with pytest.raises(IndexError):
        store.ops.recent_prune(recent, head)
    assert store.owner[0] and store.owner[1]          # nothing was taken


def test_a_recency_queue_of_non_ints_or_slots_out_of_range_raises():
    store = SlotStore(4, 4)
    _native_only(store)          # the Python loop indexes memoryviews: -1 wraps there
    store.ops.push_back(store.new_list(), [0])
    for recent in ([0, 9], [0, -1], [0, "x"], [object(), 0]):
        with pytest.raises((IndexError, TypeError)):
            store.ops.recent_take(recent, 0, 1)
        with pytest.raises((IndexError, TypeError)):
            store.ops.recent_prune(recent, 0)
    assert store.owner[0]


@pytest.mark.parametrize("bit", [-1, 2**31, 2**40])
def test_a_tier_bit_outside_int32_is_refused_and_changes_nothing(bit):
    store = SlotStore(4, 4)
    _complete(store, [0, 1])
    tiers = type(store.index)()
    with pytest.raises(ValueError):
        store.ops.register_new([0, 1], tiers, bit, False, 0)
    assert len(tiers) == 0 and len(store.index) == 0
    assert store.state[0] == slots.COMPLETE and set(store.pending) == {0, 1}
    # the same batch with a valid bit goes through, and the map is sound
    records, tiers_new, *_ = store.ops.register_new([0, 1], tiers, 4, False, 0)
    assert tiers_new and sorted(tiers.items()) == [(100, 4), (101, 4)]


def test_bulk_register_grows_both_tables_and_declines_a_batch_with_a_hash_twice():
    store = SlotStore(64, 4)
    tiers = type(store.index)()
    tiers[7] = 1                              # not in the batch: the map is still "new"
    _complete(store, range(60))
    assert store.ops.register_new(list(range(60)), tiers, 2, False, 0)[1]
    assert len(store.index) == 60 and len(tiers) == 61
    assert all(store.index[100 + i] == i and tiers[100 + i] == 2 for i in range(60))
    # a batch holding one hash twice: declined, nothing indexed, everything still pending
    store.ops.apply([60, 61], [BlockRecord(5, 5, None, 4)] * 2, 4)
    assert store.ops.register_new([60, 61], tiers, 2, False, 60) is None
    assert 5 not in store.index and 5 not in tiers and {60, 61} <= set(store.pending)


def test_unindex_of_a_hash_not_indexed_raises_and_leaves_the_index_as_it_was():
    store = SlotStore(8, 4)
    _complete(store, range(4))
    store.ops.register_new([0, 1, 2, 3], None, 0, False, 0)
    before = sorted(store.index.items())
    with pytest.raises(KeyError):
        store.ops.unindex([0, 1, 4])          # slot 4's hash (0) is not indexed
    with pytest.raises(KeyError):
        store.ops.unindex([2, 3, 2])          # a slot twice
    assert sorted(store.index.items()) == before
    assert store.ops.unindex([3, 1]) == [103, 101]
    assert sorted(store.index.items()) == [(100, 0), (102, 2)]


@pytest.mark.parametrize("bad", [-1, 8, 2**31, 2**63, 2**64, True + 0.5, "1", None])
def test_slot_ids_out_of_range_or_not_ints_are_refused(bad):
    store = SlotStore(8, 4)
    calls = [lambda ids: store.ops.claim(ids),
             lambda ids: store.ops.acquire(ids, None),
             lambda ids: store.ops.reset(ids, 0, False),
             lambda ids: store.ops.push_back(1, ids),
             lambda ids: store.ops.unlink(ids),
             lambda ids: store.ops.count_hits(ids, -1)]
    if not store.native:
        pytest.skip("the Python loops index memoryviews (negative ids wrap there)")
    store.new_list()
    for call in calls:
        with pytest.raises((IndexError, TypeError)):
            call([0, bad])
    assert not any(store.refs) and not any(store.owner)


@pytest.mark.parametrize("list_id", [0, -1, 10, 2**40])
def test_list_ids_out_of_range_are_refused(list_id):
    store = SlotStore(8, 4)
    _native_only(store)
    for call in (lambda: store.ops.push_back(list_id, [0]),
                 lambda: store.ops.push_front(list_id, 0),
                 lambda: store.ops.pop_front(list_id, 1),
                 lambda: store.ops.members(list_id)):
        with pytest.raises((IndexError, OverflowError)):
            call()


def test_index_values_past_the_slots_raise_instead_of_writing_outside():
    store = SlotStore(4, 4)
    _native_only(store)
    store.index[5] = 10**6                    # the index is writable from Python
    with pytest.raises(RuntimeError):
        store.ops.touch([5], 0, False, True, -1)
    store.index[5] = 4
    with pytest.raises(RuntimeError):
        store.ops.touch([5], 0, False, False, -1)
    # a bulk registration linking to such a "parent"
    store.ops.apply([0], [BlockRecord(9, 9, 5, 4)], 4)
    with pytest.raises(RuntimeError):
        store.ops.register_new([0], None, 0, True, 0)
    assert not any(store.tick)


@pytest.mark.parametrize("damage", ["owner", "prev", "next", "head", "cycle", "size"])
def test_damaged_links_raise_instead_of_reaching_outside(damage):
    store = SlotStore(6, 4)
    _native_only(store)
    ops, lst = store.ops, store.new_list()
    ops.push_back(lst, [0, 1, 2])
    if damage == "owner":
        store.owner[1] = 10**6
    elif damage == "prev":
        store.prev[1] = -5
    elif damage == "next":
        store.next[1] = 10**6
    elif damage == "head":
        store.head[lst] = 10**6
    elif damage == "cycle":
        store.next[2] = 0
        store.size[lst] = 5
    else:
        store.size[lst] = 7
    if damage != "prev":                      # members() follows next links only
        with pytest.raises(RuntimeError):
            ops.members(lst)
    with pytest.raises(RuntimeError):
        if damage in ("owner", "prev", "next"):
            ops.unlink([1])
        elif damage == "head":
            ops.pop_front(lst, 1)
        else:
            ops.pop_front(lst, 6)


def test_records_that_change_the_lists_while_read_cannot_crash_the_loop():
    store = SlotStore(4, 4)
    ids = [0, 1, 2]
    records = []

    class Hostile:
        block_size, token_ids, local_hash, parent_hash = 4, None, 1, None

        @property
        def sequence_hash(self):
            ids.clear()
            records.clear()
            return 7 + len(store.pending)

    records += [Hostile(), Hostile(), Hostile()]
    done = store.ops.apply(ids, records, 4)
    assert 1 <= done <= 3
    assert all(store.state[slot] == slots.COMPLETE for slot in range(done))
    assert set(store.pending) == set(range(done))


def test_a_ghost_that_changes_the_ids_while_written_cannot_crash_the_loop():
    store = SlotStore(4, 4)
    _complete(store, range(3))
    ids = [0, 1, 2]

    class Ghost(dict):
        def __setitem__(self, key, value):
            ids.clear()
            super().__setitem__(key, value)

        def move_to_end(self, key):
            pass

        def popitem(self, last=True):
            return super().popitem()

    ghost = Ghost()
    store.ops.remember(ids, ghost, 10)
    assert sorted(ghost) in ([100], [100, 101, 102])   # the Python loop sees the change


@pytest.mark.parametrize("column, replacement", [
    ("tick", lambda n: np.zeros(n, np.float64)),        # 8-byte items, not integers
    ("seq", lambda n: np.zeros(n, np.int64)),           # signed where unsigned is needed
    ("refs", lambda n: np.zeros(n, np.uint32)),         # unsigned where signed is needed
    ("refs", lambda n: np.zeros(n + 1, np.int32)),      # the wrong length
    ("refs", lambda n: np.zeros(2 * n, np.int32)[::2]),  # not contiguous
    ("state", lambda n: np.zeros(n, np.uint8).view()),  # read-only (set below)
    ("head", lambda n: np.zeros(n + 1, np.int32)),      # lists != slots + 2
])
def test_native_ops_refuse_columns_they_cannot_use(column, replacement):
    store = SlotStore(8, 4)
    _native_only(store)
    from kvstrata.logical import _slots

    names = [name for name, _ in slots.SLOT_COLUMNS + slots.LIST_COLUMNS]
    arrays = list(store.arrays)
    arrays[names.index(column)] = replacement(8)
    if column == "state":
        arrays[names.index(column)].flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        _slots.SlotOps(tuple(arrays), store.index, {}, {}, {}, 4)
    assert _slots.SlotOps(store.arrays, store.index, {}, {}, {}, 4) is not None


def test_a_stores_columns_cannot_be_resized_or_replaced():
    store = SlotStore(8, 4)
    for column in store.arrays:
        with pytest.raises(ValueError):           # would move the data the ops point at
            column.resize(10**6, refcheck=False)
    with pytest.raises(TypeError):
        store.arrays[2] = np.zeros(3, np.int32)
    store.ops.claim([7])
    assert store.refs[7] == 1 and store.arrays[2][7] == 1


def test_stores_past_int32_slot_ids_are_refused_before_allocating():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        SlotStore(2**31 - 2, 4)
    with pytest.raises(ValueError):
        SlotStore(-1, 4)


# -- the hash table: keys that share buckets, wrap around the end, and sentinel-like keys ----

_M64 = 2**64 - 1


def _mix(k: int) -> int:
    """The table's bucket hash (``mix`` in _slots.c), to build colliding keys."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _M64
    k ^= k >> 33
    return k


def _keys_homed_at(buckets: set[int], mask: int, count: int, start: int = 0) -> list[int]:
    out, k = [], start
    while len(out) < count:
        if _mix(k) & mask in buckets:
            out.append(k)
        k += 1
    return out


# keys crowded into the last buckets of a 64-bucket table, so that runs wrap around its
# end, and values that look like sentinels
_crowd = _keys_homed_at({61, 62, 63}, 63, 30) + [0, 1, _M64, _M64 - 1, 2**63, 2**32 - 1]


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "get"]),
                              st.sampled_from(_crowd), st.sampled_from([0, 1, 2**31 - 1])),
                    max_size=200))
def test_hash_index_keeps_colliding_and_wrapping_keys_through_deletions(ops):
    store = SlotStore(1, 4)
    _native_only(store)
    table, model = type(store.index)(), {}
    for op, key, value in ops:
        if op == "set":
            table[key] = value
            model[key] = value
        elif op == "del":
            assert (key in model) == (table.pop(key, None) is not None)
            model.pop(key, None)
        elif op == "pop":
            assert table.pop(key, "none") == model.pop(key, "none")
        for k in _crowd:
            assert table.get(k) == model.get(k)
        assert len(table) == len(model)
    assert sorted(table.items()) == sorted(model.items())
    assert table.nbytes <= 12 * max(8, 4 * len(model)) or len(model) < 8


def test_hash_index_through_many_deletions_keeps_its_size_and_entries():
    store = SlotStore(1, 4)
    _native_only(store)
    table = type(store.index)()
    for round_ in range(50):                  # fill, empty: no tombstones pile up
        keys = range(round_ * 1000, round_ * 1000 + 1000)
        for k in keys:
            table[k] = k % 2**31
        for k in keys:
            if k % 3:
                del table[k]
    assert len(table) == sum(1 for r in range(50) for k in range(r * 1000, r * 1000 + 1000)
                             if not k % 3)
    assert all(table[k] == k for k in range(0, 50_000, 3))
    assert table.nbytes <= 12 * 4 * len(table)   # at least 1/4 full: it did not bloat


def test_numpy_integer_hashes_are_found_as_the_ints_they_equal_on_both_paths():
    """A dict (the Python path, and the pool before the columns) finds int keys by numpy
    integers equal to them; the native table missed them. A block's own hashes stay ints."""
    from kvstrata.logical.block import BlockHashError
    from kvstrata.logical.pool import BlockPool

    pool = BlockPool("G1", 4, 4)
    big = 2**64 - 5
    handle = pool.allocate(2)
    handle.apply_token_blocks([BlockRecord(big, 1, None, 4), BlockRecord(7, 2, big, 4)])
    pool.register(handle).release()
    keys = [np.uint64(big), np.int64(7)]
    assert all(k in pool for k in keys) and pool.held(keys) == [True, True]
    assert pool.match_length(keys) == 2 and pool.lookup(keys[0]).block_id == 0
    assert pool.registry.tiers_of(keys[1]) == {"G1"}
    assert pool.touch(keys) == 2
    held = pool.acquire(keys)
    assert held.block_ids == [0, 1]
    held.release()
    for miss in (np.int64(-1), 7.0, np.float64(7), "7"):
        assert miss not in pool._index or miss == 7.0 and not pool._store.native
    fresh = pool.allocate(1)
    with pytest.raises(BlockHashError):
        fresh.apply_token_blocks([BlockRecord(np.uint64(9), 9, None, 4)])
    pool.release(fresh)
    pool.check_invariants()


def test_bools_are_not_hashes_on_either_path(native_path):
    """The slot store's Python loops took ``True`` as the hash 1 while the rest of kvstrata
    (``kvstrata.types.is_u64``) refused it; now one rule holds on both paths, and a bool
    still finds the int it equals when looked up, as in a dict."""
    from kvstrata.logical.block import BlockHashError
    from kvstrata.logical.pool import BlockPool

    pool = BlockPool("G1", 4, 4)
    for record in (BlockRecord(True, 1, None, 4), BlockRecord(5, False, None, 4),
                   BlockRecord(5, 1, True, 4)):
        handle = pool.allocate(1)
        with pytest.raises(BlockHashError):
            handle.apply_token_blocks([record])
        pool.release(handle)
    assert pool._store.native == (native_path == "native")
    handle = pool.allocate(1)
    handle.apply_token_blocks([BlockRecord(1, 1, None, 4)])
    pool.register(handle).release()
    assert True in pool and pool.held([True]) == [True]
    pool.check_invariants()


def test_bulk_register_enters_waiting_blocks_and_reports_the_rest():
    """register_new's leaf-first work: a block whose parent is held nowhere here is entered
    in the pool's table of waiting blocks (one per parent hash); blocks it cannot place
    (a parent later in the batch, a parent another block waits for) are reported unlinked,
    and blocks that children registered before them wait for as adopters. A mapping whose
    look-up fails changes nothing. unwait takes leaving blocks out of the table."""
    store = SlotStore(8, 4)
    # 0: child of 101 (later in the batch); 1: hash 101, child of 7 (held nowhere);
    # 2: hash 102 (a waiting block's parent); 3: child of 7 too (a sibling of 1)
    store.ops.apply([0, 1, 2, 3], [BlockRecord(100, 1, 101, 4), BlockRecord(101, 2, 7, 4),
                                   BlockRecord(102, 3, None, 4), BlockRecord(103, 4, 7, 4)],
                    4)

    class Broken(dict):
        def __contains__(self, key):
            raise LookupError("no")

    with pytest.raises(LookupError):
        store.ops.register_new([0, 1, 2, 3], None, 0, True, 0, Broken({1: 1}))
    assert len(store.index) == 0 and set(store.pending) == {0, 1, 2, 3}
    waiting = type(store.index)()
    waiting[102] = 6                       # some block waits for 102
    records, _, leaving, unlinked, adopters = store.ops.register_new(
        [0, 1, 2, 3], None, 0, True, 0, waiting)
    assert [r.sequence_hash for r in records] == [100, 101, 102, 103]
    assert leaving == [] and unlinked == [0, 3] and adopters == [2]
    assert sorted(waiting.items()) == [(7, 1), (102, 6)]
    assert not any(store.up[s] for s in range(4))   # the pool links them, not the loop
    # without link (not a leaf-first pool) nothing is reported or entered
    store.ops.apply([4], [BlockRecord(104, 5, 9, 4)], 4)
    waiting[104] = 6
    assert store.ops.register_new([4], None, 0, False, 4, waiting)[3:] == ([], [])
    assert 9 not in waiting
    # leaving: only the entry naming the slot goes (3 waits beside 1, not in the table)
    assert store.ops.unwait([3, 2, 0], waiting) == 0
    assert store.ops.unwait([1], waiting) == 1
    assert sorted(waiting.items()) == [(102, 6), (104, 6)]
