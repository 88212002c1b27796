"""A pool's slots as columns: one array per field, indexed by slot id (issue 13's memory).

(Over 400 lines on purpose: one concern, a pool's slot columns and the loops over them; most of
it is :class:`PySlotOps`, the Python reference of ``_slots.SlotOps`` in C, method for method.)

A registered block costs no Python object: its state, references, release tick, hashes,
tree links and policy fields are entries of fixed-width numpy arrays made for the pool's
whole capacity up front. ``np.zeros`` takes its memory from ``calloc``, whose pages are
untouched zeros until written, so an empty pool of any size reserves address space but
costs next to no resident memory (an unused column, e.g. the tree links of an ``lru`` pool,
none at all). The same arrays hold the *intrusive lists* the eviction orders are made of
(``prev`` / ``next`` / ``owner`` per slot, ``head`` / ``tail`` / ``size`` per list), and a
``HashIndex`` maps sequence hashes to slots.

The loops over a batch of slots (``SlotOps``) exist twice with the same effects: here in
Python, the reference and the fallback, and in ``kvstrata.logical._slots`` (C, built by
``pip install -e .``), which a store uses when it is built and switched on
(:func:`kvstrata.logical.blockops.use_native`) at the store's making. The Python store's
index is a plain dict; the native one is ``_slots.HashIndex``, an open-addressing table of
unsigned 64-bit keys and int32 values (12 bytes a bucket, at most 3/4 full).

Encodings: ``state`` 0-3 is :class:`~kvstrata.logical.block.BlockState`; ``flags`` bit 0 says
``parent`` holds a parent hash; ``up`` is the parent's slot + 1 (0: none); ``owner`` the
list a slot is linked in (0: none); ``count`` is the policy's per-block value
(``Block.policy_state``); ``born`` a registered slot's registration stamp (the pool's
counter: registered slots in registration order, as a dict of them would iterate). Hashes
are unsigned 64-bit integers.
"""

from __future__ import annotations

import numpy as np

from ..types import has_u64_hashes
from . import blockops

__all__ = ["SlotStore", "PySlotOps", "RESET", "PARTIAL", "COMPLETE", "REGISTERED",
           "HAS_PARENT", "U64_MAX", "MAX_SLOTS"]

RESET, PARTIAL, COMPLETE, REGISTERED = 0, 1, 2, 3
HAS_PARENT = 1
U64_MAX = 2**64 - 1
_INT32_MAX = 2**31 - 1
MAX_SLOTS = _INT32_MAX - 2
"""The most slots a store (so a pool) holds: slot ids are int32 in the columns and the
hash tables, and list ids run to ``capacity + 1``."""

SLOT_COLUMNS = (
    ("state", np.uint8), ("flags", np.uint8), ("refs", np.int32), ("tick", np.int64),
    ("seq", np.uint64), ("local", np.uint64), ("parent", np.uint64),
    ("up", np.int32), ("kids", np.int32), ("prio", np.int32), ("count", np.int64),
    ("prev", np.int32), ("next", np.int32), ("owner", np.int32), ("born", np.uint32),
)
"""Per-slot columns, in the order the native ops take them."""
LIST_COLUMNS = (("head", np.int32), ("tail", np.int32), ("size", np.int32))
"""Per-list columns (list ids 1 .. capacity + 1; 0 is "no list")."""


class SlotStore:
    """The columns of ``capacity`` slots of ``block_size`` tokens, their hash index, the
    side tables of the few slots that need more (tokens, a seed, the record applied to a
    block not yet registered) and the ops over them (native or Python, chosen now)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if not 0 <= capacity <= MAX_SLOTS:
            raise ValueError(f"a slot store holds 0 to {MAX_SLOTS:,} (2**31 - 3) slots, "
                             f"got {capacity:,}")
        self.capacity = capacity
        self.block_size = block_size
        # Views of the zeroed arrays: a view does not own its memory, so it cannot be
        # resized (``ndarray.resize(..., refcheck=False)`` would move the data the
        # memoryviews and the native ops point at). A tuple: the columns are fixed.
        try:
            columns = [np.zeros(capacity, dtype) for _, dtype in SLOT_COLUMNS]
            columns += [np.zeros(capacity + 2, dtype) for _, dtype in LIST_COLUMNS]
        except MemoryError:     # address space refused (a small host, strict overcommit)
            reserve = sum(np.dtype(d).itemsize for _, d in SLOT_COLUMNS + LIST_COLUMNS)
            raise ValueError(f"cannot reserve {capacity:,} slots ({capacity * reserve / 2**30:,.1f} "
                             f"GiB of address space, touched only as slots are used): "
                             f"make the tier smaller") from None
        self.arrays = tuple(column.view() for column in columns)
        for (name, _), array in zip(SLOT_COLUMNS + LIST_COLUMNS, self.arrays):
            setattr(self, name, array.data)      # a memoryview: Python ints in and out
        self.pending: dict = {}     # slot -> BlockRecord applied, until registered or reset
        self.tokens: dict = {}      # slot -> list of token ids (Partial, or tokens kept)
        self.seeds: dict = {}       # slot -> seed of a Partial block (when not the default)
        self._free_lists: list[int] = []
        self._lists = 0
        native = blockops.native_slots()
        if native is not None:
            self.index = native.HashIndex()
            self.ops = native.SlotOps(self.arrays, self.index, self.pending, self.tokens,
                                      self.seeds, block_size)
        else:
            self.index = {}
            self.ops = PySlotOps(self)
        self.native = native is not None

    def new_list(self) -> int:
        """An empty intrusive list's id (ids of freed lists are used again first)."""
        if self._free_lists:
            return self._free_lists.pop()
        if self._lists > self.capacity:
            raise RuntimeError("more lists than slots: a list was not freed")
        self._lists += 1
        return self._lists

    def free_list(self, list_id: int) -> None:
        """Give back an empty list's id."""
        assert self.size[list_id] == 0, f"list {list_id} freed while not empty"
        self._free_lists.append(list_id)


class PySlotOps:
    """The loops over a batch of slots, in Python (the reference; ``_slots.SlotOps`` in C
    has the same methods and effects). ``ids`` are slot ids, ``hashes`` sequence hashes."""

    def __init__(self, store: SlotStore) -> None:
        self._s = store

    # -- the index -------------------------------------------------------------------------
    def prefix(self, hashes) -> list[int]:
        """Slots of the longest prefix of ``hashes`` in the index."""
        get = self._s.index.get
        out = []
        for h in hashes:
            slot = get(h)
            if slot is None:
                break
            out.append(slot)
        return out

    def find(self, hashes) -> list[int]:
        """Slots of those of ``hashes`` in the index, in order (absent ones skipped)."""
        return [slot for slot in map(self._s.index.get, hashes) if slot is not None]

    def unindex(self, ids: list[int]) -> list[int]:
        """Drop each slot's sequence hash from the index; returns the hashes. A hash not
        indexed (or given twice) raises ``KeyError`` with the index as it was."""
        seq, index = self._s.seq, self._s.index
        out = [seq[slot] for slot in ids]
        gone: list[tuple[int, int]] = []
        for h in out:
            slot = index.pop(h, None)
            if slot is None:
                for back, was in reversed(gone):
                    index[back] = was
                raise KeyError(h)
            gone.append((h, slot))
        return out

    # -- references --------------------------------------------------------------------------
    def claim(self, ids: list[int]) -> None:
        """One reference on each (fresh from the free list)."""
        refs = self._s.refs
        for slot in ids:
            refs[slot] = 1

    def acquire(self, ids: list[int], active: set | None) -> tuple[list[int], int]:
        """One more reference on each registered slot. Returns the slots that leave the
        eviction order (those that had none; with ``active``, a leaf-first pool's set of
        registered slots in use, only those without children, and all go into ``active``)
        and how many had none."""
        refs, kids = self._s.refs, self._s.kids
        leaving: list[int] = []
        woken = 0
        for slot in ids:
            r = refs[slot]
            if r == 0:
                woken += 1
                if active is None:
                    leaving.append(slot)
                else:
                    active.add(slot)
                    if not kids[slot]:
                        leaving.append(slot)
            refs[slot] = r + 1
        return leaving, woken

    def release(self, ids: list[int], tick: int, active: set | None
                ) -> tuple[int, list[int], int]:
        """One reference less on each registered slot; those left with none get release
        tick ``tick + 1``, ``tick + 2``, ... in order. Returns the last tick, those of them
        that enter the eviction order and how many do not (with ``active``: those with
        children, which leave ``active`` like the rest)."""
        refs, ticks, kids = self._s.refs, self._s.tick, self._s.kids
        idle: list[int] = []
        parked = 0
        for slot in ids:
            r = refs[slot] - 1
            if r < 0:
                raise AssertionError(f"block {slot} released more than acquired")
            refs[slot] = r
            if r == 0:
                tick += 1
                ticks[slot] = tick
                if active is not None:
                    active.discard(slot)
                    if kids[slot]:
                        parked += 1
                        continue
                idle.append(slot)
        return tick, idle, parked

    def reset(self, ids: list[int], ref_count: int, plain: bool) -> None:
        """Each slot back to Reset (no identity, tokens, priority; unless ``plain``, no tree
        links or policy value either) with ``ref_count`` references."""
        s = self._s
        refs, state, flags, prio = s.refs, s.state, s.flags, s.prio
        up, kids, count = s.up, s.kids, s.count
        for slot in ids:
            refs[slot] = ref_count
            state[slot] = RESET
            flags[slot] = 0
            prio[slot] = 0
            if not plain:
                up[slot] = 0
                kids[slot] = 0
                count[slot] = 0
        for side in (s.pending, s.tokens, s.seeds):
            if side:
                for slot in ids:
                    side.pop(slot, None)

    # -- identity ----------------------------------------------------------------------------
    def apply(self, ids: list[int], records, size: int) -> int:
        """``Block.apply_token_block``'s stores for ``ids[i]`` from ``records[i]`` while the
        pair is valid (the slot Reset, the record of ``size`` tokens with u64 hashes, its
        tokens, if any, that many); returns how many were applied."""
        s = self._s
        state, seq, local, parent, flags = s.state, s.seq, s.local, s.parent, s.flags
        pending, tokens_of = s.pending, s.tokens
        done = 0
        for slot, record in zip(ids, records):
            if state[slot] != RESET or record.block_size != size:
                break
            tokens = record.token_ids
            if tokens is not None and len(tokens) != size:
                break
            h, local_hash, parent_hash = record.sequence_hash, record.local_hash, record.parent_hash
            if not has_u64_hashes(h, local_hash, parent_hash):
                break
            if tokens is not None:
                tokens_of[slot] = list(tokens)
            state[slot] = COMPLETE
            seq[slot] = h
            local[slot] = local_hash
            if parent_hash is None:
                flags[slot] = 0
            else:
                parent[slot] = parent_hash
                flags[slot] = HAS_PARENT
            pending[slot] = record
            done += 1
        return done

    def register_new(self, ids: list[int], tiers, bit: int, link: bool, born: int,
                     waiting=None):
        """Register a batch in bulk when nothing is deduplicated: if every slot is Complete
        with its applied record at hand and no hash is indexed or twice in the batch, index
        each and mark it Registered with stamp ``born``, ``born + 1``, ... (they must fit 32
        bits), in order; with ``link`` (a leaf-first pool), link each to its parent indexed
        here (registered before it). If ``tiers`` (a registry's map) holds none of the hashes
        either, set ``tiers[h] = bit`` too. Returns (the records, whether ``tiers`` was
        updated, the parents that gained their first child while idle, and with ``link``:
        the slots with a parent hash (not their own) left unlinked and not entered in
        ``waiting``, and the slots whose hash was a key of ``waiting``, each in order); None,
        with nothing changed, otherwise (``ValueError`` for a ``bit`` outside [0, 2**31)
        with ``tiers``). ``waiting`` is a leaf-first pool's map of parent hash -> a block
        waiting for it: a slot whose parent is held nowhere here (not indexed, not in the
        batch) is entered in it if its parent is not a key yet (the native loop enters them
        only in a table of the index's kind, and reports them as unlinked otherwise)."""
        if tiers is not None and not 0 <= bit <= _INT32_MAX:
            raise ValueError(f"a tier bit is in [0, 2**31), got {bit}")
        if not 0 <= born <= 2**32 - len(ids):
            raise ValueError(f"registration stamps {born}.. do not fit 32 bits")
        s = self._s
        state, seq, pending, index = s.state, s.seq, s.pending, s.index
        if any(state[slot] != COMPLETE or slot not in pending for slot in ids):
            return None
        hashes = [seq[slot] for slot in ids]
        if any(h in index for h in hashes) or len(set(hashes)) != len(hashes):
            return None
        adopters = [slot for slot, h in zip(ids, hashes) if h in waiting] \
            if link and waiting else []            # looked up before any change
        batch = set(hashes) if link else ()
        records = [pending.pop(slot) for slot in ids]
        leaving: list[int] = []
        unlinked: list[int] = []
        flags, parent, up, kids, refs, stamps = s.flags, s.parent, s.up, s.kids, s.refs, s.born
        for slot, h in zip(ids, hashes):
            index[h] = slot
            state[slot] = REGISTERED
            stamps[slot] = born
            born += 1
            if link and flags[slot] & HAS_PARENT:
                ph = parent[slot]
                p = index.get(ph)
                if p is None:              # not held (yet): the pool links it when it comes
                    if waiting is None or ph in batch or ph in waiting:
                        unlinked.append(slot)
                    else:
                        waiting[ph] = slot
                elif p != slot:            # a block never is its own prefix
                    up[slot] = p + 1
                    kids[p] += 1
                    if kids[p] == 1 and refs[p] == 0:
                        leaving.append(p)
        tiers_new = tiers is not None and not any(h in tiers for h in hashes)
        if tiers_new:
            for h in hashes:
                tiers[h] = bit
        return records, tiers_new, leaving, unlinked, adopters

    def unwait(self, ids: list[int], waiting) -> int:
        """A leaf-first pool's blocks leave: each that waits for its parent (none linked, a
        parent hash, and ``waiting``'s entry for that hash is this slot) leaves ``waiting``.
        Returns how many left it."""
        s = self._s
        up, flags, parent = s.up, s.flags, s.parent
        gone = 0
        for slot in ids:
            if not waiting:
                break
            if up[slot] or not flags[slot] & HAS_PARENT:
                continue
            h = parent[slot]
            if waiting.get(h) == slot:
                del waiting[h]
                gone += 1
        return gone

    # -- use ---------------------------------------------------------------------------------
    def touch(self, hashes, tick: int, leaf_first: bool, hits: bool, cap: int
              ) -> tuple[int, list[int], int]:
        """Stamp each indexed hash's slot with the next tick (and, with ``hits``, count a
        use, up to ``cap`` if it is >= 0). Returns the last tick, the idle slots among them
        that the eviction order must move (leaf-first: childless ones only), in order, and
        how many hashes were indexed."""
        s = self._s
        get, ticks, refs, kids, count = s.index.get, s.tick, s.refs, s.kids, s.count
        movers: list[int] = []
        touched = 0
        for h in hashes:
            slot = get(h)
            if slot is None:
                continue
            tick += 1
            ticks[slot] = tick
            if hits:
                c = count[slot]
                if cap < 0 or c < cap:
                    count[slot] = c + 1
            if refs[slot] == 0 and not (leaf_first and kids[slot]):
                movers.append(slot)
            touched += 1
        return tick, movers, touched

    def count_hits(self, ids: list[int], cap: int) -> None:
        """One more use on each slot's count (up to ``cap`` if it is >= 0)."""
        count = self._s.count
        for slot in ids:
            c = count[slot]
            if cap < 0 or c < cap:
                count[slot] = c + 1

    # -- intrusive lists ---------------------------------------------------------------------
    def push_back(self, list_id: int, ids: list[int]) -> None:
        """Append each slot to the list (a slot already in a list leaves it first)."""
        for slot in ids:
            self._link(list_id, slot, False)

    def push_front(self, list_id: int, slot: int) -> None:
        """Put the slot first in the list (leaving the list it is in, if any)."""
        self._link(list_id, slot, True)

    def _link(self, list_id: int, slot: int, front: bool) -> None:
        s = self._s
        if s.owner[slot]:
            self._unlink(slot)
        # towards: the link from the new end to the old one; away: back from the old end
        towards, away = (s.next, s.prev) if front else (s.prev, s.next)
        end, other_end = (s.head, s.tail) if front else (s.tail, s.head)
        old = end[list_id] if s.size[list_id] else -1
        towards[slot] = old
        away[slot] = -1
        if old >= 0:
            away[old] = slot
        else:
            other_end[list_id] = slot
        end[list_id] = slot
        s.size[list_id] += 1
        s.owner[slot] = list_id

    def _unlink(self, slot: int) -> int:
        s = self._s
        list_id = s.owner[slot]
        p, n = s.prev[slot], s.next[slot]
        if p >= 0:
            s.next[p] = n
        else:
            s.head[list_id] = n
        if n >= 0:
            s.prev[n] = p
        else:
            s.tail[list_id] = p
        s.size[list_id] -= 1
        s.owner[slot] = 0
        return list_id

    def unlink(self, ids: list[int]) -> tuple[int, list[int]]:
        """Take each slot out of its list (slots in none are skipped). Returns how many
        were taken and the lists left empty, in the order they emptied."""
        owner, size = self._s.owner, self._s.size
        taken = 0
        emptied: list[int] = []
        for slot in ids:
            if owner[slot]:
                list_id = self._unlink(slot)
                taken += 1
                if not size[list_id]:
                    emptied.append(list_id)
        return taken, emptied

    def pop_front(self, list_id: int, count: int) -> list[int]:
        """Take up to ``count`` slots from the front of the list, in order."""
        head, size = self._s.head, self._s.size
        out: list[int] = []
        while len(out) < count and size[list_id]:
            slot = head[list_id]
            self._unlink(slot)
            out.append(slot)
        return out

    def members(self, list_id: int) -> list[int]:
        """The list's slots, front to back."""
        s = self._s
        out: list[int] = []
        slot = s.head[list_id] if s.size[list_id] else -1
        while slot >= 0:
            out.append(slot)
            slot = s.next[slot]
        return out

    # -- the aged-LFU and adaptive orders' common cases ------------------------------------
    def lfu_insert(self, ids: list[int], age: int, last_tick: int, buckets: dict,
                   recent: list | None):
        """Append each slot to the list of its key ``age + count`` (``buckets``: key ->
        list id), and with ``recent`` its ``tick, slot`` pair to that queue. Only when no
        slot is in a list and the ticks rise past ``last_tick``; returns the last tick, or
        (nothing changed) the keys without a bucket yet, or None for any other case."""
        s = self._s
        owner, ticks, count = s.owner, s.tick, s.count
        t = last_tick
        for slot in ids:
            if owner[slot] or ticks[slot] <= t:
                return None
            t = ticks[slot]
        missing: list[int] = []
        for slot in ids:
            key = age + count[slot]
            if key not in buckets and key not in missing:
                missing.append(key)
        if missing:
            return missing
        for slot in ids:
            self.push_back(buckets[age + count[slot]], [slot])
            if recent is not None:
                recent += (ticks[slot], slot)
        return t

    def remember(self, ids: list[int], ghost, ghost_size: int) -> None:
        """Each slot's count into the ghost (hash -> count, oldest first, at most
        ``ghost_size``), as ``AgedFrequencyEviction.remember``."""
        seq, count = self._s.seq, self._s.count
        for slot in ids:
            h = seq[slot]
            if h in ghost:
                ghost.move_to_end(h)
            ghost[h] = count[slot]
            if len(ghost) > ghost_size:
                ghost.popitem(last=False)

    def recent_take(self, recent: list, head: int, count: int) -> tuple[list[int], int, list[int]]:
        """The next ``count`` live pairs of a recency queue from ``head`` (live: the slot is
        in a list with that tick), each slot taken out of its list. Returns the slots, the
        new head and the lists left empty."""
        if head < 0:
            raise IndexError(f"recency queue head {head} < 0")
        s = self._s
        ticks, owner, size = s.tick, s.owner, s.size
        out: list[int] = []
        emptied: list[int] = []
        end = len(recent)
        while len(out) < count and head + 1 < end:
            tick, slot = recent[head], recent[head + 1]
            head += 2
            if ticks[slot] != tick or not owner[slot]:
                continue
            list_id = self._unlink(slot)
            out.append(slot)
            if not size[list_id]:
                emptied.append(list_id)
        return out, head, emptied

    def recent_prune(self, recent: list, head: int) -> list:
        """The live pairs of a recency queue from ``head`` on, in order."""
        if head < 0:
            raise IndexError(f"recency queue head {head} < 0")
        s = self._s
        ticks, owner = s.tick, s.owner
        stamps, ids = recent[head::2], recent[head + 1::2]
        out: list = []
        for tick, slot in zip(stamps, ids):
            if ticks[slot] == tick and owner[slot]:
                out += (tick, slot)
        return out
