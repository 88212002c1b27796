"""A fixed-size pool of blocks for one tier: allocate, register (dedup), match, touch, release.

(Over 600 lines on purpose: one concern, moving a tier's slots between free, active and
inactive; every call keeps the index, eviction order, parent links and registry events in step,
hot paths inlined. The consistency checks live in :mod:`kvstrata.logical.pool_checks`.)

Block slots are ``0 .. num_blocks-1`` (the physical layer's storage for the tier has the same
slots). Every slot is in exactly one place:

* the *reset* free list (state Reset, no users);
* *active*: held by at least one handle (``ref_count > 0``);
* *inactive*: Registered, no users, still matchable; the eviction policy orders those that
  may be evicted now.

``allocate`` takes reset slots first, then evicts inactive blocks in the policy's order.
A pool is mutated only by its owner thread (one owner per pool: no locks); handles dropped
without ``release`` are returned through a queue that the owner drains on its next call.

The slots' fields are columns of a :class:`~kvstrata.logical.slots.SlotStore` (no Python
object per block); the pool's loops over a batch are the store's ops (native when built).
"""

from __future__ import annotations

from dataclasses import dataclass
from queue import SimpleQueue, Empty
from typing import Iterable, Sequence

from . import slots
from .block import Block, BlockState, BlockStateError
from .handles import HandleReleasedError, ImmutableBlocks, MutableBlocks, _Blocks
from ..types import BlockRecord, has_u64_hashes
from .eviction import EvictionPolicy, LruEviction, PriorityLruEviction
from .pool_checks import check_pool_invariants
from .slots import SlotStore
from .registry import BlockRegistry


class PoolError(RuntimeError):
    """Base class of pool errors."""


class PoolExhaustedError(PoolError):
    """``allocate(n)`` asked for more blocks than are free or evictable; nothing changed."""

    def __init__(self, tier: str, requested: int, available: int) -> None:
        super().__init__(
            f"pool {tier}: cannot allocate {requested} blocks, only {available} free or evictable"
        )
        self.requested = requested
        self.available = available


class ForeignHandleError(PoolError):
    """A handle from another pool was given to this pool."""


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """Counts of a pool's slots by place; ``active + inactive + reset == capacity``."""

    tier: str
    capacity: int
    active: int
    inactive: int
    reset: int
    evictions: int


_PRIORITY_MIN, _PRIORITY_MAX = -2**31, 2**31 - 1
_BORN_LIMIT = 2**32


class BlockPool:
    """The blocks of one tier. See the module docstring for the model."""

    def __init__(
        self,
        tier: str,
        num_blocks: int,
        block_size: int,
        *,
        eviction: EvictionPolicy | None = None,
        registry: BlockRegistry | None = None,
        keep_tokens: bool = False,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > slots.MAX_SLOTS:
            raise ValueError(f"num_blocks must be at most {slots.MAX_SLOTS:,} (2**31 - 3: "
                             f"slot ids are 32-bit), got {num_blocks:,}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.tier = tier
        self.block_size = block_size
        self.capacity = num_blocks
        self.eviction = eviction if eviction is not None else PriorityLruEviction(num_blocks)
        self.registry = registry if registry is not None else BlockRegistry()
        self.keep_tokens = keep_tokens
        self._store = SlotStore(num_blocks, block_size)
        self._ops = self._store.ops
        self._index = self._store.index
        self.eviction.attach(self._store)
        # Slots are made on first use: slots from _made on were never used. Reset slots
        # are handed out from the free stack first (ids that came back, the last one
        # first), then the lowest never-used id: deterministic allocation.
        self._made = 0
        # Registration stamps (the store's ``born``): registered slots in the order a dict
        # of them would iterate (registration order), for clear() and the like.
        self._born = 0
        self._free: list[int] = []
        self._inactive = 0
        self._tick = 0
        self._orphans: SimpleQueue[tuple[list[int], bool]] = SimpleQueue()
        self.evictions = 0
        self._leaf_first = self.eviction.leaf_first
        policy_type = type(self.eviction)
        # Skip per-block hook calls the policy does not use (the base versions do nothing).
        self._counts_hits = policy_type.record_hit is not EvictionPolicy.record_hit
        self._hit_cap = self.eviction.hit_cap() if self._counts_hits else -1
        self._tracks_registration = policy_type.registered is not EvictionPolicy.registered
        # Plain LRU pools never set a slot's tree links or policy value: resets skip them.
        self._plain_reset = type(self.eviction) is LruEviction
        # Registered blocks in use; leaf-first pools need them to count what eviction can
        # reach (None in other pools: the ops skip it).
        self._active_registered: set[int] | None = set() if self._leaf_first else None
        # Leaf-first pools: the registered blocks waiting for their parent, which is not held
        # here: parent hash -> one of them (a table like the index: 12 bytes an entry when
        # native; a hybrid model's other KV groups store many blocks without their parent),
        # and the others, if several wait for one parent. A parent registered after its
        # children adopts them (links them, so it is not evictable before them); every
        # removal takes a waiting block out.
        self._waiting = type(self._index)()
        self._waiting_more: dict[int, list[int]] = {}

    # -- side-effect-free queries ----------------------------------------------------------
    def __contains__(self, sequence_hash: int) -> bool:
        return sequence_hash in self._index

    def match_length(self, sequence_hashes: Sequence[int]) -> int:
        """Length of the longest prefix of ``sequence_hashes`` registered here (no side effect)."""
        index = self._index
        n = 0
        for h in sequence_hashes:
            if h not in index:
                break
            n += 1
        return n

    def held(self, sequence_hashes: Sequence[int]) -> list[bool]:
        """Whether each of ``sequence_hashes`` is registered here (no side effect)."""
        return list(map(self._index.__contains__, sequence_hashes))

    def can_allocate(self, count: int) -> bool:
        """Whether ``allocate(count)`` would succeed now.

        Changes nothing visible; like every pool call it first takes back the blocks of
        handles dropped without release, so it agrees with ``allocate``.
        """
        self._drain_orphans()
        return count <= self._reset_count() + len(self.eviction) \
            or count <= self._evictable_total()

    def allocatable(self) -> int:
        """How many blocks :meth:`allocate` could give now (free slots, and the idle blocks
        eviction can reach). Changes nothing visible."""
        self._drain_orphans()
        return self._evictable_total()

    def _reset_count(self) -> int:
        """Reset slots: those on the free stack plus those never used."""
        return len(self._free) + self.capacity - self._made

    def status(self) -> PoolStatus:
        """Counts of slots by place (after taking back dropped handles' blocks)."""
        self._drain_orphans()
        reset = self._reset_count()
        return PoolStatus(
            self.tier,
            self.capacity,
            self.capacity - reset - self._inactive,
            self._inactive,
            reset,
            self.evictions,
        )

    def block(self, block_id: int) -> Block:
        """A view of slot ``block_id`` (for the physical layer and tests; do not mutate)."""
        if not 0 <= block_id < self.capacity:
            raise IndexError(f"pool {self.tier}: no slot {block_id}")
        return Block(block_id, store=self._store)

    def hashes(self) -> list[int]:
        """The hashes registered here, in registration order (O(slots used); tests and
        snapshots)."""
        seq = self._store.seq
        return [seq[slot] for slot in self._registered()]

    def lookup(self, sequence_hash: int) -> Block | None:
        """A view of the registered block holding ``sequence_hash``, if any (no side effect)."""
        slot = self._index.get(sequence_hash)
        return None if slot is None else Block(slot, store=self._store)

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, count: int) -> MutableBlocks:
        """``count`` Reset blocks, evicting in policy order if needed; all or nothing."""
        if not self._orphans.empty():
            self._drain_orphans()
        if type(count) is not int and (isinstance(count, bool) or not isinstance(count, int)) \
                or count < 0:
            raise ValueError(f"cannot allocate {count!r} blocks: an integer >= 0 is needed")
        free = self._free
        made = self._made
        if count > len(free) + self.capacity - made + len(self.eviction):
            available = self._evictable_total()
            if count > available:
                raise PoolExhaustedError(self.tier, count, available)
        taken: list[int] = []
        if free:
            while len(taken) < count and free:
                taken.append(free.pop())
        if len(taken) < count and made < self.capacity:
            stop = min(made + count - len(taken), self.capacity)
            taken.extend(range(made, stop))
            self._made = stop
        self._ops.claim(taken)
        if len(taken) < count:       # victims come back Reset with one reference
            if taken:
                taken.extend(self._evict(count - len(taken)))
            else:
                taken = self._evict(count)
        return MutableBlocks(self, taken)

    def _evict(self, count: int) -> list[int]:
        eviction = self.eviction
        ops = self._ops
        if self._leaf_first:
            # One at a time: each eviction may make its parent evictable, and that parent
            # must compete for the next slot in its rightful place.
            # A parent freed this way that would be the very next victim anyway (the common
            # case: a chain goes tail first) is taken at once instead of entering the order
            # and leaving it again (``is_next``); the victims are the same.
            victims: list[int] = []
            victim, insert, is_next = eviction.victim, eviction.insert, eviction.is_next
            up, kids, refs = self._store.up, self._store.kids, self._store.refs
            slot = None
            while len(victims) < count:
                if slot is None:
                    slot = victim()
                    if slot is None:  # cannot happen: allocate checked the evictable total
                        raise AssertionError(f"pool {self.tier}: eviction order ran dry")
                victims.append(slot)
                parent = up[slot] - 1
                slot = None
                if parent >= 0:  # inlined _unlink_parent (hot path)
                    left = kids[parent] - 1
                    kids[parent] = left
                    if left == 0 and refs[parent] == 0:
                        if len(victims) < count and is_next(parent):
                            slot = parent
                        else:
                            insert(parent)
            if self._waiting:           # victims waiting for their parent wait no more
                if self._waiting_more:
                    for slot in victims:
                        if not up[slot]:
                            self._unwait(slot)
                else:
                    ops.unwait(victims, self._waiting)
            removed = ops.unindex(victims)
            ops.reset(victims, 1, False)
        else:
            victims = eviction.victims(count)
            if len(victims) < count:  # cannot happen: allocate checked the evictable total
                raise AssertionError(f"pool {self.tier}: eviction order ran dry")
            removed = ops.unindex(victims)
            ops.reset(victims, 1, self._plain_reset)
        self._inactive -= len(victims)
        self.evictions += len(victims)
        self.registry.record_removed(self.tier, removed)
        return victims

    def _evictable_total(self) -> int:
        """Free slots plus inactive blocks that eviction can reach (cascading up the tree).

        An inactive block is unreachable only if it is an ancestor of an active block in this
        pool (leaf-first policies never evict a prefix of something in use).
        """
        if not self._leaf_first:
            return self._reset_count() + len(self.eviction)
        refs = self._store.refs
        pinned_inactive = sum(1 for i in self._pinned() if refs[i] == 0)
        return self._reset_count() + self._inactive - pinned_inactive

    def _pinned(self) -> set[int]:
        """Leaf-first policies: the slots that are ancestors of a block in use (eviction
        cannot reach them while it is)."""
        pinned: set[int] = set()
        up = self._store.up
        for slot in self._active_registered:  # type: ignore[union-attr]
            parent = up[slot] - 1
            while parent >= 0 and parent not in pinned:
                pinned.add(parent)
                parent = up[parent] - 1
        return pinned

    def reachable(self, sequence_hashes: Sequence[int]) -> list[bool]:
        """Whether eviction could take each of ``sequence_hashes`` now: registered here,
        idle, and (leaf-first policies) no ancestor of a block in use. Holding such a block
        makes :meth:`allocatable` one fewer; holding any other changes nothing there.
        Changes nothing visible."""
        self._drain_orphans()
        index, refs = self._index, self._store.refs
        pinned = self._pinned() if self._leaf_first else ()
        out = []
        for h in sequence_hashes:
            slot = index.get(h)
            out.append(slot is not None and refs[slot] == 0 and slot not in pinned)
        return out

    # -- registration ----------------------------------------------------------------------
    def register(self, handle: MutableBlocks, priority: int = 0) -> ImmutableBlocks:
        """Make Complete blocks matchable; returns handles on the registered blocks.

        A hash already registered here is deduplicated: the handle points at the existing
        block and the new slot goes back to the free list. ``handle`` is consumed. If any
        block is not Complete, nothing changes and :class:`BlockStateError` is raised (a
        priority outside the int32 range: ``ValueError``).
        """
        self._check_owner(handle)
        if not self._orphans.empty():
            self._drain_orphans()
        if type(priority) is not int and (isinstance(priority, bool)
                                          or not isinstance(priority, int)) \
                or not _PRIORITY_MIN <= priority <= _PRIORITY_MAX:
            raise ValueError(f"priority must be an int32, got {priority!r}")
        ids = handle._ids
        store, ops = self._store, self._ops
        if self._born + len(ids) > _BORN_LIMIT:
            self._renumber()
        leaf_first = self._leaf_first
        if not self.keep_tokens and not (leaf_first and self._tracks_registration):
            # Fast path: every block Complete with its record at hand, no hash held yet, none
            # twice in the batch: the index (and the registry's map) are updated in bulk,
            # leaf-first pools linking each block to its parent in order (natively when built).
            registry = self.registry
            tiers, bit = registry.bulk_target(self.tier)
            done = ops.register_new(ids, tiers, bit, leaf_first, self._born,
                                    self._waiting if leaf_first else None)
            if done is not None:
                self._born += len(ids)
                handle._take()
                stored, tiers_done, leaving = done[0], done[1], done[2]
                if leaving:
                    self.eviction.remove_many(leaving)
                if priority:                   # Complete blocks have priority 0
                    prio = store.prio
                    for slot in ids:
                        prio[slot] = priority
                if leaf_first:
                    self._active_registered.update(ids)  # type: ignore[union-attr]
                    unlinked, adopters = done[3], done[4]
                    if adopters:                 # parents of blocks registered before them
                        for slot in adopters:
                            self._adopt(slot)
                    if unlinked:                 # parents not held, or later in the batch
                        self._link_unlinked(unlinked)
                if self._tracks_registration:
                    self.eviction.registered_many(ids)
                if tiers_done:
                    registry.stored_new(self.tier, stored)
                else:
                    registry.record_stored(self.tier, stored)
                return ImmutableBlocks(self, ids)
        state = store.state
        for slot in ids:
            if state[slot] != slots.COMPLETE:
                raise BlockStateError(slot, BlockState(state[slot]), "register",
                                      "must be Complete")
        handle._take()
        index = self._index
        stored = []
        keep_tokens = self.keep_tokens
        registered = self.eviction.registered if self._tracks_registration else None
        seq, prio, born = store.seq, store.prio, store.born
        out = ids                  # replaced by a copy at the first deduplicated block
        for i, slot in enumerate(ids):
            h = seq[slot]
            existing = index.get(h)
            if existing is not None:
                if out is ids:
                    out = ids[:i]
                self._acquire([existing])
                ops.reset([slot], 0, False)
                self._free.append(slot)
                out.append(existing)
                continue
            record = store.pending.pop(slot, None)
            if record is None or keep_tokens:
                record = Block(slot, store=store).record(keep_tokens)
            state[slot] = slots.REGISTERED
            prio[slot] = priority
            index[h] = slot
            born[slot] = self._born
            self._born += 1
            if leaf_first:
                self._link_parent(slot)
                if self._waiting:
                    self._adopt(slot)
                self._active_registered.add(slot)  # type: ignore[union-attr]
            if registered is not None:
                registered(slot)
            stored.append(record)
            if out is not ids:
                out.append(slot)
        self.registry.record_stored(self.tier, stored)
        return ImmutableBlocks(self, out)

    def unused_slots(self, slot_ids: Iterable[int]) -> list[int]:
        """Of ``slot_ids``, those holding no block and taken by nothing here now (never
        used, or freed): the ones whose old contents a durable tier may forget."""
        free = set(self._free)
        return [slot for slot in slot_ids if 0 <= slot < self.capacity
                and (slot >= self._made or slot in free)]

    def restore(self, entries: Sequence[tuple[int, BlockRecord]]) -> int:
        """Register blocks a durable tier recovered, each in the slot that holds its bytes;
        returns how many were restored. ``entries`` (slot, record) come oldest first and
        enter the eviction order so; they are announced as stored. An entry whose slot is
        in use or holds another block by now, or whose block is already held here, is
        skipped (the slot was reused: its old bytes are gone). A slot or hash given twice, a
        slot out of range, a record of another block size or with a hash that is not an
        unsigned 64-bit integer raises ``ValueError`` and changes nothing."""
        self._drain_orphans()
        slot_ids = [slot for slot, _ in entries]
        hashes = [record.sequence_hash for _, record in entries]
        if len(set(slot_ids)) != len(slot_ids) or len(set(hashes)) != len(hashes):
            raise ValueError(f"pool {self.tier}: restore names a slot or a block twice")
        if slot_ids and (min(slot_ids) < 0 or max(slot_ids) >= self.capacity):
            raise ValueError(f"pool {self.tier}: restore slot out of range [0, {self.capacity})")
        if any(record.block_size != self.block_size or (
                record.token_ids is not None and len(record.token_ids) != self.block_size)
               for _, record in entries):
            raise ValueError(f"pool {self.tier}: restored records must hold {self.block_size} "
                             f"tokens")
        if not all(has_u64_hashes(r.sequence_hash, r.local_hash, r.parent_hash)
                   for _, r in entries):
            raise ValueError(f"pool {self.tier}: restored hashes must be unsigned 64-bit "
                             f"integers")
        index = self._index
        free = set(self._free)
        made = self._made
        take = [(slot, record) for slot, record in entries
                if record.sequence_hash not in index and (slot >= made or slot in free)]
        if not take:
            return 0
        taken = {slot for slot, _ in take}
        grown = range(made, max(max(taken) + 1, made))
        self._made = max(made, max(taken) + 1)
        self._free = [i for i in self._free if i not in taken] + \
            [i for i in reversed(grown) if i not in taken]
        restored = [slot for slot, _ in take]
        ops, store = self._ops, self._store
        ops.apply(restored, [record for _, record in take], self.block_size)
        state, born = store.state, store.born
        if self._born + len(take) > _BORN_LIMIT:
            self._renumber()
        for slot, record in take:
            store.pending.pop(slot, None)
            state[slot] = slots.REGISTERED
            index[record.sequence_hash] = slot
            born[slot] = self._born
            self._born += 1
        if self._leaf_first:
            for slot in restored:
                self._link_parent(slot)
            self._break_cycles(restored)
            if self._waiting:              # children registered before their parent came
                for slot in restored:
                    self._adopt(slot)
        registered = self.eviction.registered if self._tracks_registration else None
        tick = self._tick
        ticks = store.tick
        for slot in restored:
            if registered is not None:
                registered(slot)
            tick += 1
            ticks[slot] = tick
        self._tick = tick
        kids = store.kids
        idle = [s for s in restored if not kids[s]] if self._leaf_first else restored
        self._inactive += len(restored)
        self.eviction.insert_many(idle)
        self.registry.record_stored(self.tier, [record for _, record in take])
        return len(restored)

    def _break_cycles(self, restored: list[int]) -> None:
        """Restored records come from outside (a journal, a listing): two that name each
        other as parents would link into a loop that eviction can never reach. Cut the link
        that closes each loop (one pass, each block visited once)."""
        up, kids = self._store.up, self._store.kids
        state: dict[int, int] = {}            # slot -> 1 on the current path, 2 done
        for start in restored:
            path = []
            slot = start
            while slot not in state:
                state[slot] = 1
                path.append(slot)
                parent = up[slot] - 1
                if parent < 0:
                    break
                if state.get(parent) == 1:           # the loop closes here
                    kids[parent] -= 1
                    up[slot] = 0
                    break
                slot = parent
            for s in path:
                state[s] = 2

    def _link_parent(self, slot: int) -> None:
        """Leaf-first pools: link the registered ``slot`` to its parent if held here, else
        wait for it (:meth:`_adopt`)."""
        store = self._store
        if not store.flags[slot] & slots.HAS_PARENT:
            return
        h = store.parent[slot]
        parent = self._index.get(h)
        if parent is None:
            if h in self._waiting:
                self._waiting_more.setdefault(h, []).append(slot)
            else:
                self._waiting[h] = slot
            return
        if parent == slot:                       # a block never is its own prefix
            return
        if store.kids[slot] and self._descends(parent, slot):
            return                               # hashes from outside: never a loop
        store.up[slot] = parent + 1
        store.kids[parent] += 1
        if store.kids[parent] == 1 and store.refs[parent] == 0:
            self.eviction.remove(parent)

    def _link_unlinked(self, unlinked: list[int]) -> None:
        """:meth:`_link_parent` for blocks just registered in bulk that the bulk loop left
        unlinked (a parent later in the batch, or one another block waits for already):
        a parent held nowhere that no block waits for yet, inlined."""
        index, waiting, parents = self._index, self._waiting, self._store.parent
        for slot in unlinked:
            h = parents[slot]
            if h in index or h in waiting:
                self._link_parent(slot)
            else:
                waiting[h] = slot

    def _adopt(self, slot: int) -> None:
        """Leaf-first pools: link the blocks registered before ``slot`` that wait for it as
        their parent. ``slot`` is not in the eviction order (just registered: held, or
        restored and not inserted yet)."""
        store = self._store
        h = store.seq[slot]
        first = self._waiting.pop(h, None)
        if first is None:
            return
        children = [first]
        if self._waiting_more:
            children += self._waiting_more.pop(h, ())
        up, kids = store.up, store.kids
        for child in children:
            if kids[child] and self._descends(slot, child):
                continue                         # it would close a loop: left unlinked
            up[child] = slot + 1
            kids[slot] += 1

    def _descends(self, slot: int, ancestor: int) -> bool:
        """Whether ``ancestor`` is ``slot`` or one of its linked ancestors."""
        up = self._store.up
        seen = 0
        while slot >= 0 and seen <= self.capacity:
            if slot == ancestor:
                return True
            slot = up[slot] - 1
            seen += 1
        return False

    def _unwait(self, slot: int) -> None:
        """``slot`` (registered, linked to no parent) leaves: it waits for its parent no
        more."""
        store = self._store
        if not store.flags[slot] & slots.HAS_PARENT:
            return
        h = store.parent[slot]
        first = self._waiting.get(h)
        if first is None:
            return
        more = self._waiting_more.get(h) if self._waiting_more else None
        if first == slot:
            if more:
                self._waiting[h] = more.pop()
            else:
                del self._waiting[h]
        elif more and slot in more:
            more.remove(slot)
        else:
            return
        if more is not None and not more:
            del self._waiting_more[h]

    def _waiting_children(self) -> dict[int, list[int]]:
        """Parent hash -> the registered blocks waiting for it (checks and tests)."""
        out: dict[int, list[int]] = {h: [slot] for h, slot in self._waiting.items()}
        for h, more in self._waiting_more.items():
            out.setdefault(h, []).extend(more)
        return out

    def _unlink_parent(self, slot: int) -> None:
        store = self._store
        parent = store.up[slot] - 1
        if parent < 0:
            if self._waiting:
                self._unwait(slot)
            return
        store.kids[parent] -= 1
        if store.kids[parent] == 0 and store.refs[parent] == 0:
            self.eviction.insert(parent)

    # -- matching and use ------------------------------------------------------------------
    def match(self, sequence_hashes: Sequence[int]) -> ImmutableBlocks:
        """Handles on the longest registered prefix of ``sequence_hashes`` (stops at a miss)."""
        if not self._orphans.empty():
            self._drain_orphans()
        found = self._ops.prefix(sequence_hashes)
        self._acquire(found)
        if self._counts_hits:
            self._ops.count_hits(found, self._hit_cap)
        return ImmutableBlocks(self, found)

    def touch(self, sequence_hashes: Iterable[int]) -> int:
        """Mark registered blocks as just used, without acquiring them; returns how many."""
        if not self._orphans.empty():
            self._drain_orphans()
        self._tick, movers, touched = self._ops.touch(
            sequence_hashes, self._tick, self._leaf_first, self._counts_hits, self._hit_cap)
        if movers:
            self.eviction.touch_many(movers)
        return touched

    def acquire(self, sequence_hashes: Iterable[int]) -> ImmutableBlocks:
        """Handles on every registered block among ``sequence_hashes`` (absent ones skipped).

        Unlike :meth:`match` it does not stop at a miss and does not count as a use (no hit
        is recorded): it is for holding blocks, e.g. the source of a copy in flight.
        """
        self._drain_orphans()
        found = self._ops.find(sequence_hashes)
        self._acquire(found)
        return ImmutableBlocks(self, found)

    def _acquire(self, ids: list[int]) -> None:
        """Take a reference on registered blocks; idle ones leave the eviction order."""
        leaving, woken = self._ops.acquire(ids, self._active_registered)
        self._inactive -= woken
        if leaving:
            self.eviction.remove_many(leaving)

    # -- release ---------------------------------------------------------------------------
    def release(self, handle: _Blocks) -> None:
        """Return a handle's blocks (registered ones stay cached and matchable)."""
        if handle._pool is not self or handle._ids is None:
            self._check_owner(handle)
        if not self._orphans.empty():
            self._drain_orphans()
        ids = handle._ids
        handle._ids = None
        self._release_ids(ids, handle._mutable)  # type: ignore[arg-type]

    def _release_ids(self, ids: list[int], mutable: bool) -> None:
        if mutable:
            self._ops.reset(ids, 0, False)
            self._free.extend(ids)
            return
        self._tick, idle, parked = self._ops.release(ids, self._tick, self._active_registered)
        self._inactive += len(idle) + parked
        if idle:
            self.eviction.insert_many(idle)

    def _post_orphans(self, block_ids: list[int], mutable: bool) -> None:
        """Finalizer target: queue a dropped handle's blocks for the owner thread."""
        self._orphans.put((block_ids, mutable))

    def _drain_orphans(self) -> None:
        orphans = self._orphans
        if orphans.empty():
            return
        while True:
            try:
                ids, mutable = orphans.get_nowait()
            except Empty:
                return
            self._release_ids(ids, mutable)

    # -- explicit eviction -----------------------------------------------------------------
    def reset_blocks(self, sequence_hashes: Iterable[int]) -> list[int]:
        """Drop the given hashes if they are idle; returns the hashes actually dropped.

        Blocks in use are left alone, and so (with a leaf-first policy) are blocks that still
        have registered children in this pool: list children before their parents to drop
        a whole idle chain.
        """
        self._drain_orphans()
        dropped: list[int] = []
        index, refs, kids = self._index, self._store.refs, self._store.kids
        for h in sequence_hashes:
            slot = index.get(h)
            if slot is None or refs[slot] or kids[slot]:
                continue
            self.eviction.remove(slot)
            del index[h]
            self._inactive -= 1
            self._unlink_parent(slot)
            self._ops.reset([slot], 0, False)
            self._free.append(slot)
            dropped.append(h)
        self.registry.record_removed(self.tier, dropped)
        return dropped

    def _registered(self) -> list[int]:
        """Registered slots in registration order (O(slots made)): the order events and the
        free list see them in (a dict of the blocks, as the pool once kept, iterates so)."""
        state = self._store.state
        return sorted((i for i in range(self._made) if state[i] == slots.REGISTERED),
                      key=self._store.born.__getitem__)

    def _renumber(self) -> None:
        """Registration stamps are 32-bit: before they would run out, number the registered
        slots again from 0, in their order (once every ~4 billion registrations)."""
        born = self._store.born
        held = self._registered()
        for i, slot in enumerate(held):
            born[slot] = i
        self._born = len(held)

    def clear(self) -> int:
        """Drop every inactive block (a "cleared" event when nothing is in use); returns count."""
        self._drain_orphans()
        refs, kids, seq = self._store.refs, self._store.kids, self._store.seq
        if any(refs[i] for i in range(self._made)):
            # Leaves first, repeatedly, so parents of dropped leaves can go too.
            total = 0
            while True:
                batch = [seq[i] for i in self._registered() if refs[i] == 0 and not kids[i]]
                if not batch:
                    return total
                total += len(self.reset_blocks(batch))
        held = self._registered()
        hashes = [seq[i] for i in held]
        self.eviction.remove_many(held)
        for h in hashes:
            del self._index[h]
        self._ops.reset(held, 0, False)
        self._free.extend(held)
        self._inactive = 0
        self._waiting.clear()
        self._waiting_more.clear()
        self.registry.record_cleared(self.tier, hashes)
        return len(held)

    def clear_slots(self) -> list[int]:
        """As :meth:`clear`; returns the slots whose blocks were dropped, for the tier's
        storage to forget them for good (a durable tier must not recover them)."""
        seq = self._store.seq
        before = {seq[slot]: slot for slot in self._registered()}
        self.clear()
        return [slot for h, slot in before.items() if h not in self]

    def drop_with_descendants(self, roots: Iterable[int]) -> list[int]:
        """Drop the idle blocks ``roots`` together with their idle descendants in this pool;
        returns the hashes dropped.

        For blocks found bad: a leaf-first pool keeps a block while children are registered,
        and those children are unreachable once their prefix is gone (matching needs the whole
        prefix). Blocks in use, and ancestors of blocks in use, stay. O(blocks held) when a
        root has children; failure paths only.
        """
        roots = list(roots)
        dropped = self.reset_blocks(roots)
        gone = set(dropped)
        index = self._index
        left = [h for h in roots if h not in gone and h in index]
        if not left or not self._leaf_first:
            return dropped
        up, seq, refs = self._store.up, self._store.seq, self._store.refs
        children: dict[int, list[int]] = {}
        for slot in self._registered():
            if up[slot]:
                children.setdefault(up[slot] - 1, []).append(seq[slot])
        order: list[int] = []
        for root in left:
            if refs[index[root]]:
                continue
            stack, subtree = [root], []
            while stack:
                h = stack.pop()
                subtree.append(h)
                stack.extend(children.get(index[h], ()))
            order.extend(reversed(subtree))   # descendants before their ancestors
        return dropped + self.reset_blocks(order)

    # -- helpers ---------------------------------------------------------------------------
    def _check_owner(self, handle: _Blocks) -> None:
        if handle.pool is not self:
            raise ForeignHandleError(f"handle belongs to pool {handle.pool.tier}, not {self.tier}")
        if handle.released:
            raise HandleReleasedError("handle already released")

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (tests and debugging; O(capacity)).
        The checks live in :mod:`kvstrata.logical.pool_checks`."""
        check_pool_invariants(self)


__all__ = [
    "BlockPool",
    "PoolStatus",
    "PoolError",
    "PoolExhaustedError",
    "ForeignHandleError",
    "LruEviction",
    "PriorityLruEviction",
]
