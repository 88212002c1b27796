"""Policies chosen online by set dueling: the ``adaptive`` eviction and admission.

No fixed policy wins everywhere. On the Mooncake conversation trace frequency (``lfu``) beats
recency (``lru``) and admitting only on second offer wins while the tier is small; on a
workload of fast agent loops recency wins, and second-offer loses badly once the tier is
large, since it gives up every block's first reuse (docs/policies.md has the numbers). Which
case holds depends on the workload and on the capacity, so the tier measures it:

* a :class:`PolicyDuel` keeps small *shadow* caches, one per candidate (eviction, admission)
  pair, each of ``capacity / sample`` blocks (metadata only: bare simulations that behave
  exactly as a :class:`BlockPool` with that eviction order would, checked by the tests);
* they replay a ``1 / sample`` spatial sample of the requests, chosen by the hash of a
  request's second block (so a conversation is sampled whole, while a system prompt shared
  by everyone does not decide the sample);
* each shadow keeps an exponentially decayed count of its prefix hits; the real tier follows
  the candidate that is ahead.

The real tier keeps every candidate's state current (both eviction orders track the same
blocks, the second-offer history records every offer), so a switch takes effect at once.
Cost: the shadows add about one extra pool operation per block of a sampled request.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import compress
from operator import eq
from typing import Callable, Sequence

from . import blockops
from .admission import AdmissionPolicy, SecondOfferAdmission
from .filters import ADMISSION_FILTERS
from .eviction import EVICTION_ORDERS, AgedFrequencyEviction, EvictionPolicy

ADAPTIVE = "adaptive"
"""Policy name (eviction or admission) whose choice is made online by set dueling."""

EVICTION_CANDIDATES = ("lru", "lfu")
ADMISSION_CANDIDATES = ("always", "second-offer")


def _admit_all(sequence_hash: int) -> bool:
    return True


def _pairs(firsts: list, seconds: list) -> list:
    """``[firsts[0], seconds[0], firsts[1], seconds[1], ...]`` (lists of one length)."""
    out = [None] * (2 * len(firsts))
    out[::2] = firsts
    out[1::2] = seconds
    return out


class _LruShadow:
    """A metadata-only one-tier LRU cache scoring one (lru, admission) candidate.

    Exactly what a :class:`BlockPool` with :class:`LruEviction` of the same capacity does
    when served a request (longest held prefix; each block touched if held, else allocated,
    registered and released if admitted, the least recently used evicted when full), as
    bare hashes: the per-block pool calls were most of the duel's cost.
    ``tests/logical/test_policy.py`` checks it against such a pool.

    Kept as :class:`DuelingEviction` keeps its recency: each use of a hash stamps it with a
    new clock value and appends ``stamp, hash`` to a queue; the least recently used hash is
    the first pair still carrying its hash's stamp. Stale pairs are pruned once the queue
    holds over twice the cache. (An ordered dict's insert, move and pop cost several times
    a dict store and two list appends.)
    """

    def __init__(self, capacity: int, admission: AdmissionPolicy) -> None:
        self.capacity = capacity
        self.admission = admission
        self._stamp: dict[int, int] = {}      # held hash -> the clock value of its last use
        self._queue: list[int] = []           # stamp, hash, stamp, hash, ... oldest first
        self._head = 0                        # index of the first pair not yet consumed
        self._clock = 0

    def held(self) -> set[int]:
        """The hashes the shadow holds (tests)."""
        return set(self._stamp)

    def serve(self, sequence_hashes: Sequence[int]) -> int:
        """Prefix hits of one request; then touch what is held and offer the rest."""
        if self.admission.learns_from_requests:      # as the planner shows it a request
            self.admission.observe_request(sequence_hashes)
        admit = None if type(self.admission) is AdmissionPolicy else self.admission.admit
        ops = blockops.native()
        if ops is not None and type(sequence_hashes) is list and self._clock < 2**62:
            hits, self._clock, self._head = ops.lru_shadow_serve(
                sequence_hashes, self._stamp, self._queue, self._head, self._clock,
                self.capacity, admit)
        else:
            hits = self._serve(sequence_hashes, admit)
        if len(self._queue) > 4 * len(self._stamp) + 128:    # the native path prunes itself
            self._prune()
        return hits

    def _serve(self, sequence_hashes: Sequence[int], admit) -> int:
        stamp, queue = self._stamp, self._queue
        hits = 0
        for h in sequence_hashes:
            if h not in stamp:
                break
            hits += 1
        capacity, clock, append = self.capacity, self._clock, queue.append
        for h in sequence_hashes:
            if h not in stamp:
                if admit is not None and not admit(h):
                    continue
                if len(stamp) >= capacity:      # evict the least recently used
                    head = self._head
                    while stamp.get(queue[head + 1]) != queue[head]:
                        head += 2
                    del stamp[queue[head + 1]]
                    self._head = head + 2
            clock += 1
            stamp[h] = clock
            append(clock)
            append(h)
        self._clock = clock
        return hits

    def _prune(self) -> None:
        stamp, queue, head = self._stamp, self._queue, self._head
        stamps, hashes = queue[head::2], queue[head + 1::2]
        live = list(map(eq, stamps, map(stamp.get, hashes)))
        self._queue = _pairs(list(compress(stamps, live)), list(compress(hashes, live)))
        self._head = 0


class _LfuShadow:
    """A metadata-only one-tier aged-LFU cache scoring one (lfu, admission) candidate.

    Exactly what a :class:`BlockPool` with :class:`AgedFrequencyEviction` (ghost of
    ``4 x capacity``) does when served a request, without the pool: a use count per held
    hash, one insertion-ordered bucket of hashes per key ``L + count`` with a small heap of
    the keys, the age ``L`` and the ghost. Every (re-)insertion is the newest release, so a
    bucket's order is the pool's tie-break by release tick.
    """

    def __init__(self, capacity: int, admission: AdmissionPolicy, ghost_factor: int = 4) -> None:
        self.capacity = capacity
        self.admission = admission
        self._count: dict[int, int] = {}          # held hash -> use count
        self._key: dict[int, int] = {}            # held hash -> its bucket's key
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._keys: list[int] = []                # heap of keys (stale ones skipped)
        self._age = 0
        self._ghost: OrderedDict[int, int] = OrderedDict()
        self._ghost_size = max(1, ghost_factor * capacity)

    def held(self) -> set[int]:
        """The hashes the shadow holds (tests)."""
        return set(self._count)

    def serve(self, sequence_hashes: Sequence[int]) -> int:
        """Prefix hits of one request, as :class:`_LruShadow` serves it."""
        if self.admission.learns_from_requests:
            self.admission.observe_request(sequence_hashes)
        ops = blockops.native()
        if ops is not None and type(sequence_hashes) is list:
            admit = None if type(self.admission) is AdmissionPolicy else self.admission.admit
            hits, self._age = ops.lfu_shadow_serve(
                sequence_hashes, self._count, self._key, self._buckets, self._keys, self._age,
                self._ghost, self._ghost_size, self.capacity, admit, OrderedDict,
                heapq.heappush, heapq.heappop)
            if len(self._keys) > 2 * len(self._buckets) + 16:
                self._keys = list(self._buckets)
                heapq.heapify(self._keys)
            return hits
        count, key_of, buckets, keys = self._count, self._key, self._buckets, self._keys
        hits = 0
        for h in sequence_hashes:
            if h not in count:
                break
            hits += 1
        admit, capacity, ghost = self.admission.admit, self.capacity, self._ghost
        if type(self.admission) is AdmissionPolicy:     # admits everything: no call per block
            admit = _admit_all
        push, pop = heapq.heappush, heapq.heappop
        for h in sequence_hashes:
            if h in count:                      # touch: a hit, re-entered as the newest
                f = count[h] + 1
                count[h] = f
                old = key_of[h]
                bucket = buckets[old]
                del bucket[h]
                if not bucket:
                    del buckets[old]
            elif admit is _admit_all or admit(h):
                if len(count) >= capacity:      # evict: lowest key, oldest in it
                    while True:
                        low = keys[0]
                        bucket = buckets.get(low)
                        if bucket:
                            break
                        pop(keys)
                    victim = bucket.popitem(last=False)[0]
                    if not bucket:
                        del buckets[low]
                        pop(keys)
                    del key_of[victim]
                    self._age = low
                    if victim in ghost:
                        ghost.move_to_end(victim)
                    ghost[victim] = count.pop(victim)
                    if len(ghost) > self._ghost_size:
                        ghost.popitem(last=False)
                f = ghost.pop(h, 0) + 1
                count[h] = f
            else:
                continue
            key = self._age + f
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = OrderedDict()
                push(keys, key)
            bucket[h] = None
            key_of[h] = key
        if len(keys) > 2 * len(buckets) + 16:
            self._keys = list(buckets)
            heapq.heapify(self._keys)
        return hits


_SHADOWS = {"lru": _LruShadow, "lfu": _LfuShadow, "default": _LruShadow}
"""The shadow simulating each eviction order. ``default`` is LRU with Dynamo's tie-breaks
(priority, leaves first), which change its hits by under 0.6 points (docs/policies.md): an
LRU shadow scores it when only the admission duels."""


def _shadow(capacity: int, eviction: str, admission: str):
    return _SHADOWS[eviction](capacity, ADMISSION_FILTERS[admission](capacity))


class PolicyDuel:
    """Scores candidate (eviction, admission) pairs on shadow caches; the best one leads."""

    def __init__(
        self,
        capacity: int,
        evictions: Sequence[str],
        admissions: Sequence[str],
        sample: int = 4,
        decay: float = 0.999,
    ) -> None:
        self.candidates = [(e, a) for e in evictions for a in admissions]
        shadow_capacity = max(1, capacity // sample)
        self._shadows = [_shadow(shadow_capacity, e, a) for e, a in self.candidates]
        self._scores = [0.0] * len(self.candidates)
        self._sample = sample
        self._decay = decay
        self.leader = 0
        """Index of the leading candidate (the first one until the shadows say otherwise)."""

    @property
    def eviction(self) -> str:
        return self.candidates[self.leader][0]

    @property
    def admission(self) -> str:
        return self.candidates[self.leader][1]

    @property
    def scores(self) -> dict[tuple[str, str], float]:
        return dict(zip(self.candidates, self._scores))

    def observe_request(self, sequence_hashes: Sequence[int]) -> None:
        """Let the shadows serve this request if it belongs to the sample."""
        if not sequence_hashes:
            return
        tag = sequence_hashes[1] if len(sequence_hashes) > 1 else sequence_hashes[0]
        if tag % self._sample:
            return
        scores, decay = self._scores, self._decay
        for i, shadow in enumerate(self._shadows):
            scores[i] = scores[i] * decay + shadow.serve(sequence_hashes)
        best = self.leader
        for i, score in enumerate(scores):
            if score > scores[best]:
                best = i
        self.leader = best


class DuelingEviction(AgedFrequencyEviction):
    """LRU and aged-LFU orders over the same blocks; victims come from the duel's leader.

    It is the aged-LFU order (inherited: buckets, counts, ghost) plus a *recency queue* for
    the LRU side: the blocks in release order, as flat ``tick, slot`` pairs, appended on
    every insert and never searched. A pair is live while its slot is in the order with
    that very release tick; a removal, or a re-insert at a newer tick, leaves the old pair
    stale, to be skipped when it reaches the front or dropped when the queue is pruned (once
    it holds over twice the order's blocks). So the LRU side costs one append per insert.

    The LRU victim is the least recently released block: what :class:`LruEviction` picks
    (its insertion order) for every insert a pool makes, since a pool stamps a newer release
    tick on each. An insert at a tick no newer than the last one (not a pool's) re-sorts the
    queue by (tick, slot), as the aged-LFU order re-sorts a bucket.
    """

    name = ADAPTIVE

    def __init__(self, capacity: int, duel: PolicyDuel) -> None:
        super().__init__(capacity)
        self._duel = duel
        self._recent: list = []     # tick, slot, tick, slot, ... in release order
        self._head = 0              # index of the first pair not yet consumed

    def insert_many(self, ids: list[int]) -> None:
        if self._insert_in_order(ids, self._recent):   # both sides in one loop
            self._tidy_recent()
            return
        last = self._last_tick
        self._insert_any(ids)
        ticks = list(map(self._ticks.__getitem__, ids))
        if ticks and (ticks[0] <= last or ticks != sorted(set(ticks))):   # not increasing
            self._requeue()
            return
        self._recent += _pairs(ticks, ids)
        self._tidy_recent()

    def victims(self, count: int) -> list[int]:
        if self._duel.eviction == "lfu":
            return super().victims(count)
        return self._recent_victims(count)

    def _recent_victims(self, count: int) -> list[int]:
        """The next ``count`` live slots of the recency queue (fewer if it runs dry), each
        leaving the aged-LFU order as ``remove`` then ``remember`` would."""
        out, self._head, emptied = self._ops.recent_take(self._recent, self._head, count)
        self._size -= len(out)
        self._free_buckets(emptied)
        self._ops.remember(out, self._ghost, self._ghost_size)
        return out

    def _tidy_recent(self) -> None:
        """Drop consumed and stale pairs once the queue holds over twice the order's blocks."""
        if len(self._recent) > 4 * len(self) + 128:
            self._recent = self._live_pairs()
            self._head = 0

    def _live_pairs(self) -> list:
        return self._ops.recent_prune(self._recent, self._head)

    def _requeue(self) -> None:
        """Rebuild the queue from the order's slots, by (release tick, slot)."""
        ticks = self._ticks
        ids = sorted(super().members(), key=lambda s: (ticks[s], s))
        self._recent = _pairs([ticks[s] for s in ids], ids)
        self._head = 0

    def members(self) -> set[int]:
        members = super().members()
        live = self._live_pairs()[1::2]
        assert len(live) == len(members) and set(live) == members, (
            f"adaptive recency queue drifted: {sorted(set(live) ^ members)[:8]}")
        return members


class DuelingAdmission(AdmissionPolicy):
    """Second-offer admission while the duel's leader uses it, admit-all otherwise."""

    name = ADAPTIVE

    def __init__(self, capacity: int, duel: PolicyDuel) -> None:
        self._duel = duel
        self._history = SecondOfferAdmission(capacity)

    def admit(self, sequence_hash: int) -> bool:
        offered_before = self._history.admit(sequence_hash)  # keep the history current
        return offered_before or self._duel.admission == "always"


def build_adaptive(eviction: str, admission: str, capacity: int
                   ) -> tuple[EvictionPolicy, AdmissionPolicy, Callable[[Sequence[int]], None]]:
    """A tier's (eviction, admission, observe_request) when either policy is ``adaptive``;
    the other one is the fixed policy named."""
    evictions = EVICTION_CANDIDATES if eviction == ADAPTIVE else (eviction,)
    admissions = ADMISSION_CANDIDATES if admission == ADAPTIVE else (admission,)
    duel = PolicyDuel(capacity, evictions, admissions)
    order = (DuelingEviction(capacity, duel) if eviction == ADAPTIVE
             else EVICTION_ORDERS[eviction](capacity))
    admit = (DuelingAdmission(capacity, duel) if admission == ADAPTIVE
             else ADMISSION_FILTERS[admission](capacity))
    if not admit.learns_from_requests:
        return order, admit, duel.observe_request

    def observe_request(sequence_hashes: Sequence[int]) -> None:
        duel.observe_request(sequence_hashes)
        admit.observe_request(sequence_hashes)
    return order, admit, observe_request
