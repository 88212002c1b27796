"""Eviction orders: which idle block of a pool goes first when a slot is needed.

An *eviction policy* orders a pool's evictable blocks (registered, no users, and, when the
policy asks for ``leaf_first``, no registered children in the pool). The pool tells it when a
block becomes evictable (``insert``), stops being evictable (``remove``), is touched while idle
(``touch``) or is used (``record_hit``), and asks it for the next ``victim``. Policies see
:class:`~kvstrata.logical.block.Block` objects and keep their own structures keyed by block id.

:data:`EVICTION_ORDERS` names the fixed orders; :mod:`kvstrata.logical.policy` builds them (and
the ``adaptive`` one) by name. docs/configuration.md says what each does, docs/policies.md how
they compare.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable

from . import blockops
from .block import Block

__all__ = ["EvictionPolicy", "LruEviction", "PriorityLruEviction", "AgedFrequencyEviction",
           "EVICTION_ORDERS"]


class EvictionPolicy:
    """Interface of an eviction order over a pool's evictable blocks."""

    name = "base"
    leaf_first = False
    """If True the pool only offers blocks with no registered children (leaves go first)."""

    def registered(self, block: Block) -> None:
        """``block`` was newly registered in the pool (not a dedup hit)."""

    def registered_many(self, blocks: list[Block]) -> None:
        """``registered`` for each of ``blocks``, in order."""
        for block in blocks:
            self.registered(block)

    def insert(self, block: Block) -> None:
        """``block`` became evictable (its ``release_tick`` is already stamped)."""
        raise NotImplementedError

    def remove(self, block: Block) -> None:
        """``block`` is no longer evictable (acquired again, reset, or gained a child)."""
        raise NotImplementedError

    def touch(self, block: Block) -> None:
        """An evictable ``block`` was used without being acquired; default: re-insert."""
        self.remove(block)
        self.insert(block)

    def record_hit(self, block: Block) -> None:
        """``block`` served a look-up (matched or touched); frequency policies count it."""

    def record_hits(self, blocks: list[Block]) -> None:
        """``record_hit`` for each of ``blocks``, in order."""
        for block in blocks:
            self.record_hit(block)

    def is_next(self, block: Block) -> bool:
        """Whether ``block``, not in the order, would be the very next victim if inserted
        now. A leaf-first pool then evicts it at once instead of inserting it (the victims
        are the same). Answering False is always correct; it only costs the round trip."""
        return False

    def victim(self) -> Block | None:
        """Remove and return the next block to evict, or None if nothing is evictable."""
        raise NotImplementedError

    # Batch forms: the pool calls these on its hot paths; override them when a policy can do
    # a batch faster than one call per block.
    def insert_many(self, blocks: list[Block]) -> None:
        for block in blocks:
            self.insert(block)

    def remove_many(self, blocks: list[Block]) -> None:
        for block in blocks:
            self.remove(block)

    def victims(self, count: int) -> list[Block]:
        """Up to ``count`` victims in order (fewer if the order runs dry)."""
        out: list[Block] = []
        for _ in range(count):
            block = self.victim()
            if block is None:
                break
            out.append(block)
        return out

    def __len__(self) -> int:
        raise NotImplementedError

    def members(self) -> set[int]:
        """Ids of the blocks currently in the order (for invariant checks; O(n))."""
        raise NotImplementedError


class LruEviction(EvictionPolicy):
    """Plain least-recently-released first, ignoring priority and the prefix tree.

    This is the exact plain LRU of docs/replay.md, used to check the replay against known
    counts.
    """

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        self._order: OrderedDict[int, Block] = OrderedDict()

    def insert(self, block: Block) -> None:
        self._order[block.block_id] = block
        self._order.move_to_end(block.block_id)  # a re-insert is the most recent use

    def remove(self, block: Block) -> None:
        self._order.pop(block.block_id, None)

    def touch(self, block: Block) -> None:
        self._order.move_to_end(block.block_id)

    def victim(self) -> Block | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[1]

    def insert_many(self, blocks: list[Block]) -> None:
        order = self._order
        before = len(order)
        for block in blocks:
            order[block.block_id] = block
        if len(order) != before + len(blocks):    # some were in already: move them last
            move = order.move_to_end
            for block in blocks:
                move(block.block_id)

    def remove_many(self, blocks: list[Block]) -> None:
        pop = self._order.pop
        for block in blocks:
            pop(block.block_id, None)

    def victims(self, count: int) -> list[Block]:
        popitem = self._order.popitem
        return [popitem(False)[1] for _ in range(min(count, len(self._order)))]

    def __len__(self) -> int:
        return len(self._order)

    def members(self) -> set[int]:
        return set(self._order)


class _TickLevel:
    """Blocks of one priority in release-tick order: an ordered dict for the common case
    (a release is the newest tick; a parent freed by its last child's eviction is usually
    the oldest) and a small lazy heap for the rest."""

    __slots__ = ("ordered", "late", "late_live", "size", "last_tick")

    def __init__(self) -> None:
        self.ordered: OrderedDict[int, Block] = OrderedDict()  # ascending release_tick
        self.late: list[tuple[int, int, Block]] = []
        self.late_live: dict[int, int] = {}
        self.size = 0
        self.last_tick = -1  # tick of the ordered dict's newest entry (-1: empty)

    def add(self, block: Block) -> None:
        ordered, tick, block_id = self.ordered, block.release_tick, block.block_id
        self.size += 1
        if tick >= self.last_tick or not ordered:
            ordered[block_id] = block
            self.last_tick = tick
        elif tick <= ordered[next(iter(ordered))].release_tick:
            ordered[block_id] = block
            ordered.move_to_end(block_id, last=False)
        else:
            self.late_live[block_id] = tick
            heapq.heappush(self.late, (tick, block_id, block))
            if len(self.late) > 4 * len(self.late_live) + 64:
                live = self.late_live
                self.late = [e for e in self.late if live.get(e[1]) == e[0]]
                heapq.heapify(self.late)

    def discard(self, block_id: int) -> None:
        ordered = self.ordered
        if ordered.pop(block_id, None) is None:
            del self.late_live[block_id]
        elif not ordered:
            self.last_tick = -1
        self.size -= 1

    def pop_oldest(self) -> Block:
        self.size -= 1
        late = self.late
        if late:
            live = self.late_live
            while late and live.get(late[0][1]) != late[0][0]:
                heapq.heappop(late)
            ordered = self.ordered
            if late and (not ordered or late[0][0] < ordered[next(iter(ordered))].release_tick):
                tick, block_id, block = heapq.heappop(late)
                del live[block_id]
                return block
        block = self.ordered.popitem(last=False)[1]
        if not self.ordered:
            self.last_tick = -1
        return block


class PriorityLruEviction(EvictionPolicy):
    """The default order (Dynamo KVBM's): lowest priority first, then least recently
    released; leaves before their prefixes.

    One :class:`_TickLevel` per priority in use. Releases append in tick order; a parent that
    becomes evictable when its last child is evicted re-enters at its *old* release tick,
    which is nearly always the oldest of its level (front of the ordered dict); anything else
    goes to the level's small heap. So the common operations are O(1).

    A block's ``policy_state`` is 1 while it is in the order (its level is its ``priority``,
    which does not change while it is evictable), 0 otherwise: no side table per block.
    """

    name = "default"
    leaf_first = True

    def __init__(self, capacity: int = 0) -> None:
        self._levels: dict[int, _TickLevel] = {}
        self._size = 0

    def insert(self, block: Block) -> None:
        if block.policy_state:  # a re-insert (touch): drop the old position
            self._discard(block)
        priority = block.priority
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _TickLevel()
        block.policy_state = 1
        level.add(block)
        self._size += 1

    def insert_many(self, blocks: list[Block]) -> None:
        levels = self._levels
        for block in blocks:
            if block.policy_state:
                self._discard(block)
            level = levels.get(block.priority)
            if level is None:
                level = levels[block.priority] = _TickLevel()
            block.policy_state = 1
            level.add(block)
        self._size += len(blocks)

    def remove(self, block: Block) -> None:
        if block.policy_state:
            self._discard(block)

    def remove_many(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.policy_state:
                self._discard(block)

    def _discard(self, block: Block) -> None:
        level = self._levels[block.priority]
        level.discard(block.block_id)
        block.policy_state = 0
        self._size -= 1
        if not level.size:
            del self._levels[block.priority]

    def victim(self) -> Block | None:
        levels = self._levels
        if not levels:
            return None
        priority = next(iter(levels)) if len(levels) == 1 else min(levels)
        level = levels[priority]
        block = level.pop_oldest()
        block.policy_state = 0
        self._size -= 1
        if not level.size:
            del levels[priority]
        return block

    def is_next(self, block: Block) -> bool:
        levels = self._levels
        if not levels:
            return True
        lowest = next(iter(levels)) if len(levels) == 1 else min(levels)
        if block.priority != lowest:
            return block.priority < lowest
        level = levels[lowest]
        tick = block.release_tick
        ordered = level.ordered
        if ordered and ordered[next(iter(ordered))].release_tick < tick:
            return False
        late = level.late
        if late:
            live = level.late_live
            while late and live.get(late[0][1]) != late[0][0]:
                heapq.heappop(late)
            if late and late[0][0] < tick:
                return False
        return True

    def __len__(self) -> int:
        return self._size

    def members(self) -> set[int]:
        out: set[int] = set()
        for level in self._levels.values():
            out.update(level.ordered)
            out.update(level.late_live)
        return out


class AgedFrequencyEviction(EvictionPolicy):
    """Least-frequently-used with dynamic aging and a ghost history ("lfu").

    Each block's use count ``f`` lives in ``block.policy_state``: 1 when registered (plus
    what the ghost remembers of it), +1 per hit. An evictable block's key is ``L + f``, where
    ``L`` is the key of the last victim; the lowest key goes first, ties by least recently
    used. Aging through ``L`` lets yesterday's popular blocks give way to today's. Evicted
    blocks leave their count in a FIFO ghost of ``ghost_factor x capacity`` hashes, so a block
    that comes back soon resumes its count instead of starting cold.

    Why: on multi-turn traces most blocks are used once, while a block used twice is likely
    to be used again; LRU cannot tell them apart, frequency can (docs/policies.md).

    Kept as one bucket per key, each an ordered dict in release-tick order (a block enters
    with the newest tick, so it is appended), and a small heap of the keys in use: every
    operation is O(1) but for the key heap, which holds a handful of keys. The order is
    exactly the heap order of ``(key, release_tick, block_id)``.
    """

    name = "lfu"

    def __init__(self, capacity: int = 0, ghost_factor: int = 4, max_count: int | None = None) -> None:
        self._max_count = max_count
        self._age = 0
        self._ghost: OrderedDict[int, int] = OrderedDict()
        self._ghost_size = max(1, ghost_factor * capacity)
        self._key_of: dict[int, int] = {}                  # block id -> its key, in the order
        self._buckets: dict[int, OrderedDict[int, Block]] = {}
        self._keys: list[int] = []                         # heap of keys (stale ones skipped)
        self._last_tick = -1                               # newest release tick inserted

    def registered(self, block: Block) -> None:
        block.policy_state = self._ghost.pop(block.sequence_hash, 0) + 1  # type: ignore[arg-type]

    def registered_many(self, blocks: list[Block]) -> None:
        pop = self._ghost.pop
        for block in blocks:
            block.policy_state = pop(block.sequence_hash, 0) + 1  # type: ignore[arg-type]

    def record_hit(self, block: Block) -> None:
        if self._max_count is None or block.policy_state < self._max_count:
            block.policy_state += 1

    def record_hits(self, blocks: list[Block]) -> None:
        if self._max_count is not None:
            EvictionPolicy.record_hits(self, blocks)
            return
        for block in blocks:
            block.policy_state += 1

    def key(self, block: Block) -> int:
        return self._age + block.policy_state

    def insert(self, block: Block) -> None:
        self.insert_many([block])

    def insert_many(self, blocks: list[Block]) -> None:
        ops = blockops.native()
        if ops is not None:     # the common case natively (new blocks, newest ticks)
            last = ops.lfu_insert(blocks, self._key_of, self._buckets, self._keys, self._age,
                                  self._last_tick, OrderedDict, heapq.heappush)
            if last is not None:
                self._last_tick = last
                self._tidy_keys()
                return
        self._insert_python(blocks)

    def _insert_python(self, blocks: list[Block]) -> None:
        """``insert_many``'s Python path: any blocks, in the order or not, any ticks."""
        key_of, buckets, age = self._key_of, self._buckets, self._age
        last = self._last_tick
        for block in blocks:
            block_id = block.block_id
            old = key_of.get(block_id)
            if old is not None:                    # a re-insert: drop the old position
                self._drop(block_id, old)
            key = age + block.policy_state
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = OrderedDict()
                heapq.heappush(self._keys, key)
            bucket[block_id] = block
            key_of[block_id] = key
            tick = block.release_tick
            if tick > last:                        # the newest release: in order at the end
                last = tick
            elif len(bucket) > 1:                  # not newer than everything: re-sort
                ordered = sorted(bucket.values(), key=lambda b: (b.release_tick, b.block_id))
                bucket.clear()
                bucket.update((b.block_id, b) for b in ordered)
        self._last_tick = last
        self._tidy_keys()

    def _tidy_keys(self) -> None:
        """Rebuild the key heap once stale keys (of emptied buckets) outnumber live ones."""
        if len(self._keys) > 2 * len(self._buckets) + 16:
            self._keys = list(self._buckets)
            heapq.heapify(self._keys)

    def _drop(self, block_id: int, key: int) -> None:
        bucket = self._buckets[key]
        del bucket[block_id]
        if not bucket:
            del self._buckets[key]

    def remove(self, block: Block) -> None:
        key = self._key_of.pop(block.block_id, None)
        if key is not None:
            self._drop(block.block_id, key)

    def remove_many(self, blocks: list[Block]) -> None:
        pop, buckets = self._key_of.pop, self._buckets
        for block in blocks:
            key = pop(block.block_id, None)
            if key is not None:                   # inlined _drop
                bucket = buckets[key]
                del bucket[block.block_id]
                if not bucket:
                    del buckets[key]

    def victim(self) -> Block | None:
        out = self.victims(1)
        return out[0] if out else None

    def victims(self, count: int) -> list[Block]:
        """Up to ``count`` victims in order, each evicted as ``victim`` would."""
        ops = blockops.native()
        if ops is not None:
            out, key = ops.lfu_victims(count, self._keys, self._buckets, self._key_of,
                                       self._ghost, self._ghost_size, heapq.heappop)
            if key is not None:
                self._age = key
            return out
        out: list[Block] = []
        keys, buckets, key_of, ghost = self._keys, self._buckets, self._key_of, self._ghost
        size = self._ghost_size
        while len(out) < count and keys:
            key = keys[0]
            bucket = buckets.get(key)
            if bucket is None:                     # stale key: its bucket emptied
                heapq.heappop(keys)
                continue
            block_id, block = bucket.popitem(last=False)
            if not bucket:
                del buckets[key]
                heapq.heappop(keys)
            del key_of[block_id]
            self._age = key
            h = block.sequence_hash                # inlined remember
            if h in ghost:
                ghost.move_to_end(h)  # type: ignore[arg-type]
            ghost[h] = block.policy_state  # type: ignore[index]
            if len(ghost) > size:
                ghost.popitem(last=False)
            out.append(block)
        return out

    def remember(self, block: Block) -> None:
        """Keep an evicted block's count in the ghost (also used when another order evicted it)."""
        ghost, h = self._ghost, block.sequence_hash
        if h in ghost:
            ghost.move_to_end(h)  # type: ignore[arg-type]
        ghost[h] = block.policy_state  # type: ignore[index]
        if len(ghost) > self._ghost_size:
            ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._key_of)

    def members(self) -> set[int]:
        return set(self._key_of)


EVICTION_ORDERS: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LruEviction,
    "default": PriorityLruEviction,
    "lfu": AgedFrequencyEviction,
}
"""The fixed eviction orders by name; each is built from the tier's capacity."""
