"""Eviction orders: which idle block of a pool goes first when a slot is needed.

(About 500 lines on purpose: one concern, the eviction orders; the interface and its three
fixed orders share the pool's calls and the store's intrusive lists, so they read side by side.)

An *eviction policy* orders a pool's evictable blocks (registered, no users, and, when the
policy asks for ``leaf_first``, no registered children in the pool). The pool tells it when a
block becomes evictable (``insert``), stops being evictable (``remove``), is touched while idle
(``touch``) or is used (``record_hit``), and asks it for the next ``victim``. Policies see
slot ids: a pool attaches its :class:`~kvstrata.logical.slots.SlotStore`, whose columns
hold each block's fields (release tick, priority, the policy's per-block value ``count``)
and whose intrusive lists (``prev`` / ``next`` / ``owner`` per slot) are the orders: no
Python object per block.

:data:`EVICTION_ORDERS` names the fixed orders; :mod:`kvstrata.logical.policy` builds them (and
the ``adaptive`` one) by name. docs/configuration.md says what each does, docs/policies.md how
they compare.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable

from .slots import SlotStore

__all__ = ["EvictionPolicy", "LruEviction", "PriorityLruEviction", "AgedFrequencyEviction",
           "EVICTION_ORDERS"]


class EvictionPolicy:
    """Interface of an eviction order over a pool's evictable blocks (by slot id)."""

    name = "base"
    leaf_first = False
    """If True the pool only offers blocks with no registered children (leaves go first)."""

    _store: SlotStore | None = None

    def attach(self, store: SlotStore) -> None:
        """Serve the pool whose slots ``store`` holds (once: a policy orders one pool)."""
        if self._store is not None:
            raise ValueError(f"eviction policy {self.name!r} already serves a pool; "
                             f"make one per pool")
        self._store = store
        self._ops = store.ops

    def registered(self, slot: int) -> None:
        """``slot`` was newly registered in the pool (not a dedup hit)."""

    def registered_many(self, ids: list[int]) -> None:
        """``registered`` for each of ``ids``, in order."""
        for slot in ids:
            self.registered(slot)

    def insert(self, slot: int) -> None:
        """``slot`` became evictable (its release tick is already stamped)."""
        raise NotImplementedError

    def remove(self, slot: int) -> None:
        """``slot`` is no longer evictable (acquired again, reset, or gained a child)."""
        raise NotImplementedError

    def touch(self, slot: int) -> None:
        """An evictable ``slot`` was used without being acquired; default: re-insert."""
        self.remove(slot)
        self.insert(slot)

    def touch_many(self, ids: list[int]) -> None:
        """``touch`` for each of ``ids``, in order."""
        for slot in ids:
            self.touch(slot)

    def record_hit(self, slot: int) -> None:
        """``slot`` served a look-up (matched or touched); frequency policies count it."""

    def hit_cap(self) -> int:
        """The most uses a block's ``count`` holds (-1: no cap). A pool whose policy
        overrides :meth:`record_hit` counts uses in its own loops (``count`` + 1, up to the
        cap): ``record_hit`` must do the same."""
        return -1

    def is_next(self, slot: int) -> bool:
        """Whether ``slot``, not in the order, would be the very next victim if inserted
        now. A leaf-first pool then evicts it at once instead of inserting it (the victims
        are the same). Answering False is always correct; it only costs the round trip."""
        return False

    def victim(self) -> int | None:
        """Remove and return the next slot to evict, or None if nothing is evictable."""
        raise NotImplementedError

    # Batch forms: the pool calls these on its hot paths; override them when a policy can do
    # a batch faster than one call per block.
    def insert_many(self, ids: list[int]) -> None:
        for slot in ids:
            self.insert(slot)

    def remove_many(self, ids: list[int]) -> None:
        for slot in ids:
            self.remove(slot)

    def victims(self, count: int) -> list[int]:
        """Up to ``count`` victims in order (fewer if the order runs dry)."""
        out: list[int] = []
        for _ in range(count):
            slot = self.victim()
            if slot is None:
                break
            out.append(slot)
        return out

    def __len__(self) -> int:
        raise NotImplementedError

    def members(self) -> set[int]:
        """Slots currently in the order (for invariant checks; O(n))."""
        raise NotImplementedError


class LruEviction(EvictionPolicy):
    """Plain least-recently-released first, ignoring priority and the prefix tree.

    This is the exact plain LRU of docs/replay.md, used to check the replay against known
    counts. One intrusive list of the store, oldest first: 8 bytes a block, O(1) per block.
    """

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        pass

    def attach(self, store: SlotStore) -> None:
        super().attach(store)
        self._list = store.new_list()
        self._size = store.size

    def insert(self, slot: int) -> None:
        self._ops.push_back(self._list, [slot])   # a re-insert is the most recent use

    def remove(self, slot: int) -> None:
        self._ops.unlink([slot])

    def touch(self, slot: int) -> None:
        self._ops.push_back(self._list, [slot])

    def touch_many(self, ids: list[int]) -> None:
        self._ops.push_back(self._list, ids)

    def victim(self) -> int | None:
        out = self._ops.pop_front(self._list, 1)
        return out[0] if out else None

    def insert_many(self, ids: list[int]) -> None:
        self._ops.push_back(self._list, ids)

    def remove_many(self, ids: list[int]) -> None:
        self._ops.unlink(ids)

    def victims(self, count: int) -> list[int]:
        return self._ops.pop_front(self._list, count)

    def __len__(self) -> int:
        return self._size[self._list] if self._store is not None else 0

    def members(self) -> set[int]:
        return set(self._ops.members(self._list))


class _TickLevel:
    """Slots of one priority in release-tick order: an intrusive list for the common case
    (a release is the newest tick; a parent freed by its last child's eviction is usually
    the oldest) and a small lazy heap of ``(tick, slot)`` for the rest."""

    __slots__ = ("list_id", "late", "late_live", "size", "last_tick")

    def __init__(self, list_id: int) -> None:
        self.list_id = list_id                  # ascending release tick
        self.late: list[tuple[int, int]] = []
        self.late_live: dict[int, int] = {}
        self.size = 0
        self.last_tick = -1  # tick of the list's newest entry (-1: empty)


class PriorityLruEviction(EvictionPolicy):
    """The default order (Dynamo KVBM's): lowest priority first, then least recently
    released; leaves before their prefixes.

    One :class:`_TickLevel` per priority in use. Releases append in tick order; a parent that
    becomes evictable when its last child is evicted re-enters at its *old* release tick,
    which is nearly always the oldest of its level (front of its list); anything else goes to
    the level's small heap. So the common operations are O(1).

    A slot's ``count`` is 1 while it is in the order (its level is its priority, which does
    not change while it is evictable), 0 otherwise.
    """

    name = "default"
    leaf_first = True

    def __init__(self, capacity: int = 0) -> None:
        self._levels: dict[int, _TickLevel] = {}
        self._size = 0

    def attach(self, store: SlotStore) -> None:
        super().attach(store)
        self._ticks, self._prio, self._in = store.tick, store.prio, store.count
        self._head, self._lsize = store.head, store.size

    def insert(self, slot: int) -> None:
        self.insert_many([slot])

    def insert_many(self, ids: list[int]) -> None:
        levels, member, prio, ticks = self._levels, self._in, self._prio, self._ticks
        ops, head, lsize = self._ops, self._head, self._lsize
        for slot in ids:
            if member[slot]:            # a re-insert (touch): drop the old position
                self._discard(slot)
            priority = prio[slot]
            level = levels.get(priority)
            if level is None:
                level = levels[priority] = _TickLevel(self._store.new_list())
            member[slot] = 1
            level.size += 1
            list_id, tick = level.list_id, ticks[slot]
            if tick >= level.last_tick or not lsize[list_id]:
                ops.push_back(list_id, [slot])
                level.last_tick = tick
            elif tick <= ticks[head[list_id]]:
                ops.push_front(list_id, slot)
            else:
                level.late_live[slot] = tick
                heapq.heappush(level.late, (tick, slot))
                if len(level.late) > 4 * len(level.late_live) + 64:
                    live = level.late_live
                    level.late = [e for e in level.late if live.get(e[1]) == e[0]]
                    heapq.heapify(level.late)
        self._size += len(ids)

    def remove(self, slot: int) -> None:
        if self._in[slot]:
            self._discard(slot)

    def remove_many(self, ids: list[int]) -> None:
        member = self._in
        for slot in ids:
            if member[slot]:
                self._discard(slot)

    def _discard(self, slot: int) -> None:
        priority = self._prio[slot]
        level = self._levels[priority]
        if self._store.owner[slot]:     # type: ignore[union-attr]
            self._ops.unlink([slot])
            if not self._lsize[level.list_id]:
                level.last_tick = -1
        else:
            del level.late_live[slot]
        self._in[slot] = 0
        self._size -= 1
        level.size -= 1
        if not level.size:
            self._drop_level(priority)

    def _drop_level(self, priority: int) -> None:
        level = self._levels.pop(priority)
        self._store.free_list(level.list_id)   # type: ignore[union-attr]

    def _late_front(self, level: _TickLevel) -> tuple[int, int] | None:
        """The level's oldest live late entry, stale ones popped."""
        late, live = level.late, level.late_live
        while late and live.get(late[0][1]) != late[0][0]:
            heapq.heappop(late)
        return late[0] if late else None

    def victim(self) -> int | None:
        levels = self._levels
        if not levels:
            return None
        priority = next(iter(levels)) if len(levels) == 1 else min(levels)
        level = levels[priority]
        list_id = level.list_id
        late = self._late_front(level) if level.late else None
        if late is not None and (not self._lsize[list_id]
                                 or late[0] < self._ticks[self._head[list_id]]):
            heapq.heappop(level.late)
            slot = late[1]
            del level.late_live[slot]
        else:
            slot = self._ops.pop_front(list_id, 1)[0]
            if not self._lsize[list_id]:
                level.last_tick = -1
        self._in[slot] = 0
        self._size -= 1
        level.size -= 1
        if not level.size:
            self._drop_level(priority)
        return slot

    def is_next(self, slot: int) -> bool:
        levels = self._levels
        if not levels:
            return True
        lowest = next(iter(levels)) if len(levels) == 1 else min(levels)
        priority = self._prio[slot]
        if priority != lowest:
            return priority < lowest
        level = levels[lowest]
        tick = self._ticks[slot]
        list_id = level.list_id
        if self._lsize[list_id] and self._ticks[self._head[list_id]] < tick:
            return False
        if level.late:
            late = self._late_front(level)
            if late is not None and late[0] < tick:
                return False
        return True

    def __len__(self) -> int:
        return self._size

    def members(self) -> set[int]:
        out: set[int] = set()
        for level in self._levels.values():
            out.update(self._ops.members(level.list_id))
            out.update(level.late_live)
        return out


class AgedFrequencyEviction(EvictionPolicy):
    """Least-frequently-used with dynamic aging and a ghost history ("lfu").

    Each block's use count ``f`` is its slot's ``count``: 1 when registered (plus what the
    ghost remembers of it), +1 per hit. An evictable block's key is ``L + f``, where ``L``
    is the key of the last victim; the lowest key goes first, ties by least recently used.
    Aging through ``L`` lets yesterday's popular blocks give way to today's. Evicted blocks
    leave their count in a FIFO ghost of ``ghost_factor x capacity`` hashes, so a block that
    comes back soon resumes its count instead of starting cold.

    Why: on multi-turn traces most blocks are used once, while a block used twice is likely
    to be used again; LRU cannot tell them apart, frequency can (docs/policies.md).

    Kept as one bucket per key, each an intrusive list of the store in release-tick order (a
    block enters with the newest tick, so it is appended), and a small heap of the keys in
    use: every operation is O(1) but for the key heap, which holds a handful of keys. The
    order is exactly the heap order of ``(key, release_tick, slot)``.
    """

    name = "lfu"

    def __init__(self, capacity: int = 0, ghost_factor: int = 4, max_count: int | None = None) -> None:
        self._max_count = max_count
        self._age = 0
        self._ghost: OrderedDict[int, int] = OrderedDict()
        self._ghost_size = max(1, ghost_factor * capacity)
        self._buckets: dict[int, int] = {}                 # key -> its list
        self._key_of_list: dict[int, int] = {}             # list -> its key
        self._keys: list[int] = []                         # heap of keys (stale ones skipped)
        self._last_tick = -1                               # newest release tick inserted
        self._size = 0

    def attach(self, store: SlotStore) -> None:
        super().attach(store)
        self._count, self._ticks, self._seq = store.count, store.tick, store.seq
        self._owner, self._lsize = store.owner, store.size

    def registered(self, slot: int) -> None:
        self._count[slot] = self._ghost.pop(self._seq[slot], 0) + 1

    def registered_many(self, ids: list[int]) -> None:
        pop, count, seq = self._ghost.pop, self._count, self._seq
        for slot in ids:
            count[slot] = pop(seq[slot], 0) + 1

    def record_hit(self, slot: int) -> None:
        self._ops.count_hits([slot], self.hit_cap())

    def hit_cap(self) -> int:
        return -1 if self._max_count is None else self._max_count

    def key(self, slot: int) -> int:
        return self._age + self._count[slot]

    def insert(self, slot: int) -> None:
        self.insert_many([slot])

    def insert_many(self, ids: list[int]) -> None:
        if self._insert_in_order(ids, None):
            return
        self._insert_any(ids)

    def _insert_in_order(self, ids: list[int], recent: list | None) -> bool:
        """The common case in one loop of the store's ops (natively when built): no slot in
        the order yet, ticks rising past the newest. Whether it applied."""
        got = self._ops.lfu_insert(ids, self._age, self._last_tick, self._buckets, recent)
        if type(got) is list:                      # keys without a bucket: make them
            for key in got:
                self._new_bucket(key)
            got = self._ops.lfu_insert(ids, self._age, self._last_tick, self._buckets, recent)
        if got is None:
            return False
        self._last_tick = got
        self._size += len(ids)
        self._tidy_keys()
        return True

    def _new_bucket(self, key: int) -> int:
        list_id = self._buckets[key] = self._store.new_list()   # type: ignore[union-attr]
        self._key_of_list[list_id] = key
        heapq.heappush(self._keys, key)
        return list_id

    def _insert_any(self, ids: list[int]) -> None:
        """``insert_many`` for any slots, in the order or not, at any ticks."""
        buckets, age, count, ticks = self._buckets, self._age, self._count, self._ticks
        owner, push = self._owner, self._ops.push_back
        last = self._last_tick
        for slot in ids:
            if owner[slot]:                        # a re-insert: drop the old position
                self._drop([slot])
            self._size += 1
            key = age + count[slot]
            list_id = buckets.get(key)
            if list_id is None:
                list_id = self._new_bucket(key)
            push(list_id, [slot])
            tick = ticks[slot]
            if tick > last:                        # the newest release: in order at the end
                last = tick
            elif self._lsize[list_id] > 1:         # not newer than everything: re-sort
                ordered = sorted(self._ops.members(list_id), key=lambda s: (ticks[s], s))
                push(list_id, ordered)
        self._last_tick = last
        self._tidy_keys()

    def _tidy_keys(self) -> None:
        """Rebuild the key heap once stale keys (of emptied buckets) outnumber live ones."""
        if len(self._keys) > 2 * len(self._buckets) + 16:
            self._keys = list(self._buckets)
            heapq.heapify(self._keys)

    def _drop(self, ids: list[int]) -> None:
        """Take ``ids`` (in the order) out of their buckets; empty buckets go."""
        taken, emptied = self._ops.unlink(ids)
        self._size -= taken
        self._free_buckets(emptied)

    def remove(self, slot: int) -> None:
        self.remove_many([slot])

    def remove_many(self, ids: list[int]) -> None:
        self._drop(ids)

    def victim(self) -> int | None:
        out = self.victims(1)
        return out[0] if out else None

    def victims(self, count: int) -> list[int]:
        """Up to ``count`` victims in order, each evicted as ``victim`` would."""
        out: list[int] = []
        keys, buckets, lsize = self._keys, self._buckets, self._lsize
        while len(out) < count and keys:
            key = keys[0]
            list_id = buckets.get(key)
            if list_id is None:                    # stale key: its bucket emptied
                heapq.heappop(keys)
                continue
            got = self._ops.pop_front(list_id, count - len(out))
            self._size -= len(got)
            self._age = key
            self._ops.remember(got, self._ghost, self._ghost_size)
            out += got
            if not lsize[list_id]:
                del buckets[key]
                del self._key_of_list[list_id]
                self._store.free_list(list_id)     # type: ignore[union-attr]
                heapq.heappop(keys)
        return out

    def remember(self, slot: int) -> None:
        """Keep an evicted block's count in the ghost (also used when another order evicted it)."""
        self._ops.remember([slot], self._ghost, self._ghost_size)

    def _free_buckets(self, emptied: list[int]) -> None:
        for list_id in emptied:
            del self._buckets[self._key_of_list.pop(list_id)]
            self._store.free_list(list_id)         # type: ignore[union-attr]

    def __len__(self) -> int:
        return self._size

    def members(self) -> set[int]:
        out: set[int] = set()
        for list_id in self._buckets.values():
            out.update(self._ops.members(list_id))
        return out


EVICTION_ORDERS: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LruEviction,
    "default": PriorityLruEviction,
    "lfu": AgedFrequencyEviction,
}
"""The fixed eviction orders by name; each is built from the tier's capacity."""
