"""A fixed-size pool of blocks for one tier: allocate, register (dedup), match, touch, release.

(About 500 lines on purpose: one concern, a tier's slots, with its hot paths inlined; the
consistency checks live in :mod:`kvstrata.logical.pool_checks`.)

Block slots are ``0 .. num_blocks-1`` (the physical layer's storage for the tier has the same
slots). Every slot is in exactly one place:

* the *reset* free list (state Reset, no users);
* *active*: held by at least one handle (``ref_count > 0``);
* *inactive*: Registered, no users, still matchable; the eviction policy orders those that
  may be evicted now.

``allocate`` takes reset slots first, then evicts inactive blocks in the policy's order.
A pool is mutated only by its owner thread (one owner per pool: no locks); handles dropped
without ``release`` are returned through a queue that the owner drains on its next call.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from queue import SimpleQueue, Empty
from typing import Iterable, Sequence

from .block import Block, BlockState, BlockStateError
from .blockops import register_new, release_registered, reset_all
from .handles import HandleReleasedError, ImmutableBlocks, MutableBlocks, _Blocks
from ..types import BlockRecord
from .eviction import EvictionPolicy, LruEviction, PriorityLruEviction
from .pool_checks import check_pool_invariants
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
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.tier = tier
        self.block_size = block_size
        self.capacity = num_blocks
        self.eviction = eviction if eviction is not None else PriorityLruEviction(num_blocks)
        self.registry = registry if registry is not None else BlockRegistry()
        self.keep_tokens = keep_tokens
        # Slots are made on first use: an empty pool of any capacity costs next to nothing.
        # _blocks[i] is slot i for i < len(_blocks); slots from len(_blocks) on were never
        # used. Reset slots are handed out from the free stack first (ids that came back,
        # the last one first), then the lowest never-used id: deterministic allocation.
        self._blocks: list[Block] = []
        self._free: list[int] = []
        self._by_hash: dict[int, Block] = {}
        self._inactive = 0
        self._tick = 0
        self._orphans: SimpleQueue[tuple[list[int], bool]] = SimpleQueue()
        self.evictions = 0
        self._leaf_first = self.eviction.leaf_first
        policy_type = type(self.eviction)
        # Skip per-block hook calls the policy does not use (the base versions do nothing).
        self._counts_hits = policy_type.record_hit is not EvictionPolicy.record_hit
        self._tracks_registration = policy_type.registered is not EvictionPolicy.registered
        # Plain LRU pools never set a block's tree links or policy state: resets skip them.
        self._plain_reset = type(self.eviction) is LruEviction
        # Registered blocks in use; leaf-first pools need them to count what eviction can reach.
        self._active_registered: set[int] = set()

    # -- side-effect-free queries ----------------------------------------------------------
    def __contains__(self, sequence_hash: int) -> bool:
        return sequence_hash in self._by_hash

    def match_length(self, sequence_hashes: Sequence[int]) -> int:
        """Length of the longest prefix of ``sequence_hashes`` registered here (no side effect)."""
        by_hash = self._by_hash
        n = 0
        for h in sequence_hashes:
            if h not in by_hash:
                break
            n += 1
        return n

    def held(self, sequence_hashes: Sequence[int]) -> list[bool]:
        """Whether each of ``sequence_hashes`` is registered here (no side effect)."""
        return list(map(self._by_hash.__contains__, sequence_hashes))

    def can_allocate(self, count: int) -> bool:
        """Whether ``allocate(count)`` would succeed now.

        Changes nothing visible; like every pool call it first takes back the blocks of
        handles dropped without release, so it agrees with ``allocate``.
        """
        self._drain_orphans()
        return count <= self._reset_count() + len(self.eviction) \
            or count <= self._evictable_total()

    def _reset_count(self) -> int:
        """Reset slots: those on the free stack plus those never used."""
        return len(self._free) + self.capacity - len(self._blocks)

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
        """The slot ``block_id`` (for the physical layer and tests; do not mutate)."""
        if not 0 <= block_id < self.capacity:
            raise IndexError(f"pool {self.tier}: no slot {block_id}")
        if block_id >= len(self._blocks):
            return Block(block_id, self.block_size)      # never used: Reset, not kept
        return self._blocks[block_id]

    def lookup(self, sequence_hash: int) -> Block | None:
        """The registered block holding ``sequence_hash``, if any (no side effect)."""
        return self._by_hash.get(sequence_hash)

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, count: int) -> MutableBlocks:
        """``count`` Reset blocks, evicting in policy order if needed; all or nothing."""
        if not self._orphans.empty():
            self._drain_orphans()
        if type(count) is not int and (isinstance(count, bool) or not isinstance(count, int)) \
                or count < 0:
            raise ValueError(f"cannot allocate {count!r} blocks: an integer >= 0 is needed")
        free = self._free
        blocks = self._blocks
        if count > len(free) + self.capacity - len(blocks) + len(self.eviction):
            available = self._evictable_total()
            if count > available:
                raise PoolExhaustedError(self.tier, count, available)
        taken: list[Block] = []
        if free:
            while len(taken) < count and free:
                taken.append(blocks[free.pop()])
        if len(taken) < count and len(blocks) < self.capacity:
            first = len(blocks)
            fresh = [Block(i, self.block_size)
                     for i in range(first, min(first + count - len(taken), self.capacity))]
            blocks.extend(fresh)
            taken.extend(fresh)
        for block in taken:
            block.ref_count = 1
        if len(taken) < count:       # victims come back Reset with ref_count 1
            if taken:
                taken.extend(self._evict(count - len(taken)))
            else:
                taken = self._evict(count)
        return MutableBlocks(self, taken)

    def _evict(self, count: int) -> list[Block]:
        victims: list[Block] = []
        removed: list[int] = []
        eviction = self.eviction
        by_hash = self._by_hash
        if self._leaf_first:
            # One at a time: each eviction may make its parent evictable, and that parent
            # must compete for the next slot in its rightful place.
            # A parent freed this way that would be the very next victim anyway (the common
            # case: a chain goes tail first) is taken at once instead of entering the order
            # and leaving it again (``is_next``); the victims are the same.
            victim, insert, blocks = eviction.victim, eviction.insert, self._blocks
            is_next = eviction.is_next
            block = None
            while len(victims) < count:
                if block is None:
                    block = victim()
                    if block is None:  # cannot happen: allocate checked the evictable total
                        raise AssertionError(f"pool {self.tier}: eviction order ran dry")
                h = block.sequence_hash
                removed.append(h)  # type: ignore[arg-type]
                del by_hash[h]
                victims.append(block)
                parent_id = block.parent_id
                block = None
                if parent_id >= 0:  # inlined _unlink_parent (hot path)
                    parent = blocks[parent_id]
                    parent.children -= 1
                    if parent.children == 0 and parent.ref_count == 0:
                        if len(victims) < count and is_next(parent):
                            block = parent
                        else:
                            insert(parent)
            reset_all(victims, 1)
        else:
            victims = eviction.victims(count)
            if len(victims) < count:  # cannot happen: allocate checked the evictable total
                raise AssertionError(f"pool {self.tier}: eviction order ran dry")
            removed = [block.sequence_hash for block in victims]  # type: ignore[misc]
            for h in removed:
                del by_hash[h]
            reset_all(victims, 1, self._plain_reset)
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
        pinned: set[int] = set()
        blocks = self._blocks
        for block_id in self._active_registered:
            parent = blocks[block_id].parent_id
            while parent >= 0 and parent not in pinned:
                pinned.add(parent)
                parent = blocks[parent].parent_id
        pinned_inactive = sum(1 for i in pinned if blocks[i].ref_count == 0)
        return self._reset_count() + self._inactive - pinned_inactive

    # -- registration ----------------------------------------------------------------------
    def register(self, handle: MutableBlocks, priority: int = 0) -> ImmutableBlocks:
        """Make Complete blocks matchable; returns handles on the registered blocks.

        A hash already registered here is deduplicated: the handle points at the existing
        block and the new slot goes back to the free list. ``handle`` is consumed. If any
        block is not Complete, nothing changes and :class:`BlockStateError` is raised.
        """
        self._check_owner(handle)
        if not self._orphans.empty():
            self._drain_orphans()
        blocks = handle.blocks
        by_hash = self._by_hash
        leaf_first = self._leaf_first
        if not self.keep_tokens and not (leaf_first and self._tracks_registration):
            # Fast path: every block Complete with its record at hand, no hash held yet, none
            # twice in the batch: the index (and the registry's map) are updated in bulk,
            # leaf-first pools linking each block to its parent in order (natively when built).
            registry = self.registry
            tiers, bit = registry.bulk_target(self.tier)
            done = register_new(blocks, by_hash, tiers, bit,
                                self.eviction.remove if leaf_first else None)
            if done is not None:
                handle._take()
                stored, tiers_done = done
                if priority:                   # Complete blocks have priority 0
                    for block in blocks:
                        block.priority = priority
                if leaf_first:
                    self._active_registered.update(map(_id_of, blocks))
                if self._tracks_registration:
                    self.eviction.registered_many(blocks)
                if tiers_done:
                    registry.stored_new(self.tier, stored)
                else:
                    registry.record_stored(self.tier, stored)
                return ImmutableBlocks(self, blocks)
        complete = BlockState.COMPLETE
        if list(map(_state_of, blocks)).count(complete) != len(blocks):
            for block in blocks:
                if block.state is not complete:
                    raise BlockStateError(block.block_id, block.state, "register",
                                          "must be Complete")
        handle._take()
        get = by_hash.get
        stored = []
        keep_tokens = self.keep_tokens
        leaf_first = self._leaf_first
        registered = self.eviction.registered if self._tracks_registration else None
        state_registered = BlockState.REGISTERED
        out = blocks               # replaced by a copy at the first deduplicated block
        for i, block in enumerate(blocks):
            h = block.sequence_hash
            existing = get(h)  # type: ignore[arg-type]
            if existing is not None:
                if out is blocks:
                    out = blocks[:i]
                self._acquire(existing)
                block.reset()
                block.ref_count = 0
                self._free.append(block.block_id)
                out.append(existing)
                continue
            block.state = state_registered
            block.priority = priority
            by_hash[h] = block  # type: ignore[index]
            if leaf_first:
                self._link_parent(block)
                self._active_registered.add(block.block_id)
            if registered is not None:
                registered(block)
            record = block.cached_record
            if record is None or keep_tokens:
                record = block.record(keep_tokens)
            stored.append(record)
            if out is not blocks:
                out.append(block)
        self.registry.record_stored(self.tier, stored)
        return ImmutableBlocks(self, out)

    def restore(self, entries: Sequence[tuple[int, BlockRecord]]) -> int:
        """Register blocks a durable tier recovered, each in the slot that holds its bytes;
        returns how many were restored. ``entries`` (slot, record) come oldest first and
        enter the eviction order so; they are announced as stored. An entry whose slot is
        in use or holds another block by now, or whose block is already held here, is
        skipped (the slot was reused: its old bytes are gone). A slot or hash given twice, a
        slot out of range or a record of another block size raises ``ValueError`` and
        changes nothing."""
        self._drain_orphans()
        slots = [slot for slot, _ in entries]
        hashes = [record.sequence_hash for _, record in entries]
        if len(set(slots)) != len(slots) or len(set(hashes)) != len(hashes):
            raise ValueError(f"pool {self.tier}: restore names a slot or a block twice")
        if slots and (min(slots) < 0 or max(slots) >= self.capacity):
            raise ValueError(f"pool {self.tier}: restore slot out of range [0, {self.capacity})")
        if any(record.block_size != self.block_size for _, record in entries):
            raise ValueError(f"pool {self.tier}: restored records must hold {self.block_size} "
                             f"tokens")
        blocks = self._blocks
        free = set(self._free)
        take = [(slot, record) for slot, record in entries
                if record.sequence_hash not in self._by_hash
                and (slot >= len(blocks) or slot in free)]
        if not take:
            return 0
        taken = {slot for slot, _ in take}
        grown = range(len(blocks), max(taken) + 1)
        blocks.extend(Block(i, self.block_size) for i in grown)
        self._free = [i for i in self._free if i not in taken] + \
            [i for i in reversed(grown) if i not in taken]
        restored: list[Block] = []
        by_hash, state = self._by_hash, BlockState.REGISTERED
        for slot, record in take:      # Block.apply_token_block, inlined (checked above)
            block = blocks[slot]
            block.state = state
            block.sequence_hash = record.sequence_hash
            block.local_hash = record.local_hash
            block.parent_hash = record.parent_hash
            block.cached_record = record
            if record.token_ids is not None:
                block.tokens = list(record.token_ids)
            by_hash[record.sequence_hash] = block
            restored.append(block)
        if self._leaf_first:
            for block in restored:
                self._link_parent(block)
            self._break_cycles(restored)
        registered = self.eviction.registered if self._tracks_registration else None
        tick = self._tick
        for block in restored:
            if registered is not None:
                registered(block)
            tick += 1
            block.release_tick = tick
        self._tick = tick
        idle = [b for b in restored if not b.children] if self._leaf_first else restored
        self._inactive += len(restored)
        self.eviction.insert_many(idle)
        self.registry.record_stored(self.tier, [record for _, record in take])
        return len(restored)

    def _break_cycles(self, restored: list[Block]) -> None:
        """Restored records come from outside (a journal, a listing): two that name each
        other as parents would link into a loop that eviction can never reach. Cut the link
        that closes each loop (one pass, each block visited once)."""
        blocks = self._blocks
        state: dict[int, int] = {}            # block id -> 1 on the current path, 2 done
        for start in restored:
            path = []
            block = start
            while block.block_id not in state:
                state[block.block_id] = 1
                path.append(block)
                if block.parent_id < 0:
                    break
                parent = blocks[block.parent_id]
                if state.get(parent.block_id) == 1:           # the loop closes here
                    parent.children -= 1
                    block.parent_id = -1
                    break
                block = parent
            for b in path:
                state[b.block_id] = 2

    def _link_parent(self, block: Block) -> None:
        parent = self._by_hash.get(block.parent_hash) if block.parent_hash is not None else None
        if parent is None or parent is block:     # a block never is its own prefix
            return
        block.parent_id = parent.block_id
        parent.children += 1
        if parent.children == 1 and parent.ref_count == 0:
            self.eviction.remove(parent)

    def _unlink_parent(self, block: Block) -> None:
        if block.parent_id < 0:
            return
        parent = self._blocks[block.parent_id]
        parent.children -= 1
        if parent.children == 0 and parent.ref_count == 0:
            self.eviction.insert(parent)

    # -- matching and use ------------------------------------------------------------------
    def match(self, sequence_hashes: Sequence[int]) -> ImmutableBlocks:
        """Handles on the longest registered prefix of ``sequence_hashes`` (stops at a miss)."""
        self._drain_orphans()
        by_hash = self._by_hash
        found: list[Block] = []
        for h in sequence_hashes:
            block = by_hash.get(h)
            if block is None:
                break
            found.append(block)
        self._acquire_many(found)
        if self._counts_hits:
            self.eviction.record_hits(found)
        return ImmutableBlocks(self, found)

    def touch(self, sequence_hashes: Iterable[int]) -> int:
        """Mark registered blocks as just used, without acquiring them; returns how many."""
        self._drain_orphans()
        by_hash = self._by_hash
        eviction = self.eviction
        leaf_first = self._leaf_first
        touched = 0
        record_hit = eviction.record_hit if self._counts_hits else None
        move = eviction.touch
        tick = self._tick
        for h in sequence_hashes:
            block = by_hash.get(h)
            if block is None:
                continue
            tick += 1
            block.release_tick = tick
            if record_hit is not None:
                record_hit(block)
            if block.ref_count == 0 and not (leaf_first and block.children):
                move(block)
            touched += 1
        self._tick = tick
        return touched

    def acquire(self, sequence_hashes: Iterable[int]) -> ImmutableBlocks:
        """Handles on every registered block among ``sequence_hashes`` (absent ones skipped).

        Unlike :meth:`match` it does not stop at a miss and does not count as a use (no hit
        is recorded): it is for holding blocks, e.g. the source of a copy in flight.
        """
        self._drain_orphans()
        by_hash = self._by_hash
        found = [b for b in (by_hash.get(h) for h in sequence_hashes) if b is not None]
        self._acquire_many(found)
        return ImmutableBlocks(self, found)

    def _acquire(self, block: Block) -> None:
        self._acquire_many([block])

    def _acquire_many(self, blocks: list[Block]) -> None:
        """Take a reference on registered blocks; idle ones leave the eviction order."""
        leaving: list[Block] = []
        leaf_first = self._leaf_first
        for block in blocks:
            if block.ref_count == 0:
                self._inactive -= 1
                if leaf_first:
                    self._active_registered.add(block.block_id)
                    if not block.children:
                        leaving.append(block)
                else:
                    leaving.append(block)
            block.ref_count += 1
        if leaving:
            self.eviction.remove_many(leaving)

    # -- release ---------------------------------------------------------------------------
    def release(self, handle: _Blocks) -> None:
        """Return a handle's blocks (registered ones stay cached and matchable)."""
        if handle._pool is not self or handle._blocks is None:
            self._check_owner(handle)
        if not self._orphans.empty():
            self._drain_orphans()
        blocks = handle._blocks
        handle._blocks = None
        self._release_blocks(blocks, handle._mutable)

    def _release_blocks(self, blocks: list[Block], mutable: bool) -> None:
        if mutable:
            free = self._free
            for block in blocks:
                block.reset()
                block.ref_count = 0
                free.append(block.block_id)
            return
        idle: list[Block] = []
        tick = self._tick
        if self._leaf_first:
            discard = self._active_registered.discard
            for block in blocks:
                block.ref_count -= 1
                assert block.ref_count >= 0, f"block {block.block_id} released more than acquired"
                if block.ref_count == 0:
                    tick += 1
                    block.release_tick = tick
                    discard(block.block_id)
                    if block.children:
                        self._inactive += 1
                        continue
                    idle.append(block)
        else:
            tick, idle = release_registered(blocks, tick)
        self._tick = tick
        self._inactive += len(idle)
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
            self._release_blocks([self._blocks[i] for i in ids], mutable)

    # -- explicit eviction -----------------------------------------------------------------
    def reset_blocks(self, sequence_hashes: Iterable[int]) -> list[int]:
        """Drop the given hashes if they are idle; returns the hashes actually dropped.

        Blocks in use are left alone, and so (with a leaf-first policy) are blocks that still
        have registered children in this pool: list children before their parents to drop
        a whole idle chain.
        """
        self._drain_orphans()
        dropped: list[int] = []
        for h in sequence_hashes:
            block = self._by_hash.get(h)
            if block is None or block.ref_count or block.children:
                continue
            self.eviction.remove(block)
            del self._by_hash[h]
            self._inactive -= 1
            self._unlink_parent(block)
            block.reset()
            self._free.append(block.block_id)
            dropped.append(h)
        self.registry.record_removed(self.tier, dropped)
        return dropped

    def clear(self) -> int:
        """Drop every inactive block (a "cleared" event when nothing is in use); returns count."""
        self._drain_orphans()
        in_use = any(b.ref_count for b in self._blocks)
        if in_use:
            # Leaves first, repeatedly, so parents of dropped leaves can go too.
            total = 0
            while True:
                batch = [
                    h for h, b in self._by_hash.items() if b.ref_count == 0 and not b.children
                ]
                if not batch:
                    return total
                total += len(self.reset_blocks(batch))
        held = list(self._by_hash)
        for block in self._by_hash.values():
            self.eviction.remove(block)
            block.reset()
            self._free.append(block.block_id)
        self._by_hash.clear()
        self._inactive = 0
        self.registry.record_cleared(self.tier, held)
        return len(held)

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
        left = [h for h in roots if h not in gone and h in self._by_hash]
        if not left or not self._leaf_first:
            return dropped
        children: dict[int, list[int]] = {}
        for block in self._by_hash.values():
            if block.parent_id >= 0:
                children.setdefault(block.parent_id, []).append(block.sequence_hash)  # type: ignore[arg-type]
        order: list[int] = []
        for root in left:
            if self._by_hash[root].ref_count:
                continue
            stack, subtree = [root], []
            while stack:
                h = stack.pop()
                subtree.append(h)
                stack.extend(children.get(self._by_hash[h].block_id, ()))
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

_state_of = attrgetter("state")
_hash_of = attrgetter("sequence_hash")
_record_of = attrgetter("cached_record")
_id_of = attrgetter("block_id")


__all__ = [
    "BlockPool",
    "PoolStatus",
    "PoolError",
    "PoolExhaustedError",
    "ForeignHandleError",
    "LruEviction",
    "PriorityLruEviction",
]
