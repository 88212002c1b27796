"""The ``predicted-reuse`` admission filter: refuse blocks of a kind that rarely comes back.

Most blocks a KV cache stores are never looked up again (on the Mooncake conversation trace,
three in four), and what decides a cache's hit rate is mostly whether it spends its slots on
the ones that do (docs/policies.md, "Why the gap stays open"). This filter learns, online,
which *kinds* of block return, and refuses a block whose kind returned less than
:data:`THRESHOLD` of the time. It is signature-based reuse prediction (SHiP, from CPU caches)
with signatures a prefix cache can see:

* whether the block is its request's **last** one shown (in traces where a prompt ends
  inside its last block, the next turn's block there differs and it almost never returns;
  an engine that shows only full blocks gets the opposite, and the filter learns that too);
* how many of its request's blocks are **new** (a one-off document brings dozens at once, a
  conversation turn a few), in powers of two;
* whether the request **continues** a recent one (its first two blocks were seen lately).

"Seen lately" means among the last :data:`HISTORY` capacities' worth of blocks shown: a
:class:`RecentHashes` table, 30 bytes per block of the tier (its pages are all touched soon
after start), at most :data:`MAX_WINDOW` hashes.

Learning follows a sample: one block in :data:`SAMPLE` (by hash), admitted or not, counts
as reused for its kind if a request shows it again before the tier has admitted
``capacity`` more blocks (about as long as an LRU tier keeps an untouched block; refused
offers do not count), or if it is shown again before it is even offered, and as not reused
otherwise; the "seen lately" table tells, when the horizon has passed or before it would
forget the sample (a ring of the samples waiting, 21 bytes each, about 3 bytes per block
of the tier). A block shown again before its offer is admitted whatever its kind: it has
come back. Being shown again does not depend on being kept (a refused block is computed
again), so refusing a kind does not stop the filter from seeing it come back. A request's
last block is refused with its parent when both are new: alone it could never hit. Counts are halved every :data:`WINDOW` outcomes, so the filter
follows a workload that changes. Kinds never measured, and blocks whose request was not
shown (``observe_request``), are admitted.

The filter needs to see each request's block hashes before the blocks are offered
(:meth:`PredictedReuseAdmission.observe_request`, fed by the planner as the ``adaptive``
duel is). It is not thread-safe: one thread shows requests and offers blocks (the planner's
callers do). Its constants were chosen on eight traces and checked on eleven held out; the
horizon and the history scale with the tier (docs/policies.md, "predicted-reuse").
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from . import blockops
from .admission import AdmissionPolicy, PolicyError

__all__ = ["PredictedReuseAdmission", "RecentHashes", "THRESHOLD", "SAMPLE", "WINDOW"]

THRESHOLD = 0.07
"""A kind whose sampled blocks were reused less often than this is refused."""
SAMPLE = 32
"""One block in ``SAMPLE`` (by hash) is followed to learn from."""
WINDOW = 2048
"""A kind's counts are halved when they reach this many outcomes."""
HISTORY = 4
"""Slots of the "seen lately" table per block of the tier."""
MAX_WINDOW = 1 << 28
"""The longest "seen lately" history, in hashes (2 GiB)."""
CONTEXTS = 1 << 16
"""Blocks of shown requests whose kind waits for their offer: between ``CONTEXTS`` and
``4 x CONTEXTS`` are kept (the oldest dropped; a longer request keeps its last ones)."""

_NEW_BUCKETS = 7            # new-block counts 0-1, 2-3, 4-7, ... 64+
_KINDS = 2 * _NEW_BUCKETS * 2
_MASK64 = (1 << 64) - 1
_RETURNED = 32              # a kind flagged: shown again before it was offered
_AFTER_NEW = 64             # a last block whose parent is new in its request too
_SAMPLED = 128              # a block followed to learn from (one in SAMPLE, by hash)
_NEVER = 1 << 62


def _mixed(sequence_hash: int) -> int:
    """A well-spread 64-bit value of a hash, every bit depending on every bit (the
    splitmix64 finaliser): trace hashes can be small consecutive ints. The C loop
    (``_blockops.recent_held_then_add``) computes the same."""
    x = int(sequence_hash) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _set_starts(mixed: int, sets: int) -> tuple[int, int]:
    """The first slots of the two 4-way sets a hash may live in (as the C loop picks them)."""
    return (mixed >> 40) % sets * 4, ((mixed >> 16) & 0xFFFFFF) % sets * 4


def _new_bucket(new_blocks: int) -> int:
    return min(max(new_blocks, 1).bit_length() - 1, _NEW_BUCKETS - 1)


class RecentHashes:
    """Which hashes were among the last ``window`` added, approximately, in fixed memory.

    Sets of four (16-bit fingerprint, 32-bit stamp) pairs, a quarter more pairs than the
    window holds hashes (7.5 bytes per hash of the window). A hash may live in either of
    two sets picked by its :func:`_mixed` value (two-choice hashing keeps the sets evenly
    filled); it is held if one of them has its fingerprint with a stamp under ``window``
    additions old, and an addition takes the first pair with its fingerprint, else the
    oldest of the eight. About 3 % of the window's hashes drop out early (random hashes;
    the tests measure it), and a false "held" needs a 16-bit fingerprint match among eight
    pairs (about 1 look-up in 5,000). The loop runs in C when the native code is built
    (``_blockops.recent_held_then_add``), with the same effects.
    """

    _WAYS = 4
    SLACK = 1.25

    def __init__(self, window: int) -> None:
        if window <= 0:
            raise PolicyError(f"a history window must be positive, got {window}")
        window = min(window, MAX_WINDOW)
        self._sets = max(2, -(-int(window * self.SLACK) // self._WAYS))
        slots = self._sets * self._WAYS
        try:    # zeroed by calloc: pages are touched only as hashes are added
            self._fingerprints = np.zeros(slots, np.uint16)
            self._stamps = np.zeros(slots, np.uint32)
        except MemoryError:
            raise ValueError(f"cannot reserve a history of {window:,} hashes "
                             f"({slots * 6 / 2**30:,.1f} GiB of address space) for "
                             f"predicted-reuse admission: make the tier smaller") from None
        self._window = window
        self._now = 0

    def held_then_add(self, sequence_hashes: Sequence[int],
                      sample: int = SAMPLE) -> tuple[int, list[int]]:
        """How many of ``sequence_hashes``, from the first, were held, and the positions of
        those sampled (one in ``sample``: ``(_mixed(h) >> 20) % sample == 0``); each is then
        added, in order."""
        ops = blockops.native()
        if ops is not None:
            known, self._now, sampled = ops.recent_held_then_add(
                sequence_hashes, self._fingerprints, self._stamps, self._sets, self._window,
                self._now, sample)
            return known, sampled
        return self._held_then_add(sequence_hashes, sample)

    def _held_then_add(self, sequence_hashes: Sequence[int],
                       sample: int = SAMPLE) -> tuple[int, list[int]]:
        prints, stamps = self._fingerprints.data, self._stamps.data   # memoryviews: fast
        sets, window, clock = self._sets, self._window, self._now
        known, counting, sampled = 0, True, []
        for i, h in enumerate(sequence_hashes):
            mixed = _mixed(h)
            if (mixed >> 20) % sample == 0:
                sampled.append(i)
            fingerprint = (mixed & 0xFFFF) | 1
            first = oldest = -1
            oldest_age, held = 0, False
            for start in _set_starts(mixed, sets):
                for slot in range(start, start + 4):
                    age = (clock - stamps[slot]) & 0xFFFFFFFF if prints[slot] else 1 << 32
                    if prints[slot] == fingerprint:
                        if first < 0:
                            first = slot
                        held = held or age < window
                    if oldest < 0 or age > oldest_age:
                        oldest, oldest_age = slot, age
            if counting:
                if held:
                    known += 1
                else:
                    counting = False
            clock = (clock + 1) & 0xFFFFFFFF
            slot = first if first >= 0 else oldest
            prints[slot] = fingerprint
            stamps[slot] = clock
        self._now = clock
        return known, sampled

    @property
    def window(self) -> int:
        """How many of the latest additions it holds."""
        return self._window

    @property
    def clock(self) -> int:
        """How many hashes were added so far, modulo 2**32 (the stamp of the last one)."""
        return self._now

    def added_since(self, sequence_hash: int, clock: int) -> bool:
        """Whether ``sequence_hash`` was added after the addition stamped ``clock``, within
        the window."""
        mixed = _mixed(sequence_hash)
        fingerprint = (mixed & 0xFFFF) | 1
        prints, stamps = self._fingerprints.data, self._stamps.data
        since = (self._now - clock) & 0xFFFFFFFF          # additions after ``clock``
        for start in _set_starts(mixed, self._sets):
            for slot in range(start, start + 4):
                if prints[slot] == fingerprint:
                    age = (self._now - stamps[slot]) & 0xFFFFFFFF
                    if age < since and age < self._window:
                        return True
        return False

    def holds(self, sequence_hash: int) -> bool:
        """Whether ``sequence_hash`` was added within the last ``window`` additions."""
        return self.added_since(sequence_hash, (self._now - self._window) & 0xFFFFFFFF)


class _Samples:
    """The followed blocks, oldest first: a ring of (hash, history clock and admission
    count at the offer, kind) in arrays, 21 bytes an entry."""

    def __init__(self, size: int) -> None:
        self._hashes = np.zeros(size, np.uint64).data
        self._shown = np.zeros(size, np.uint32).data
        self._admitted = np.zeros(size, np.int64).data
        self._kinds = np.zeros(size, np.uint8).data
        self._size, self._head, self.count = size, 0, 0

    def full(self) -> bool:
        return self.count >= self._size

    def push(self, sequence_hash: int, shown_at: int, admitted: int, kind: int) -> None:
        """Add a sample (the ring must not be full: the caller judges the oldest first)."""
        at = (self._head + self.count) % self._size
        self._hashes[at] = sequence_hash & _MASK64
        self._shown[at], self._admitted[at], self._kinds[at] = shown_at, admitted, kind
        self.count += 1

    def oldest_admitted(self) -> int:
        return self._admitted[self._head]

    def oldest_shown(self) -> int:
        return self._shown[self._head]

    def pop(self) -> tuple[int, int, int]:
        at = self._head
        self._head, self.count = (at + 1) % self._size, self.count - 1
        return self._hashes[at], self._shown[at], self._kinds[at]


class PredictedReuseAdmission(AdmissionPolicy):
    """Admit a block unless blocks of its kind have rarely been reused (see the module)."""

    name = "predicted-reuse"
    learns_from_requests = True
    keeps_prefixes = True

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise PolicyError(f"predicted-reuse needs a positive capacity, got {capacity}")
        self._horizon = capacity
        self._seen = RecentHashes(HISTORY * capacity)
        # hash -> kind | flags, for blocks shown and not yet offered: a newer and an older
        # generation (the older is dropped when the newer passes CONTEXTS)
        self._kinds: dict[int, int] = {}
        self._older_kinds: dict[int, int] = {}
        self._samples = _Samples(self._seen.window // SAMPLE + 64)
        self._reused = [1] * _KINDS
        self._outcomes = [2] * _KINDS
        self._keep = [True] * _KINDS  # per kind: reused often enough (kept current by _learn)
        self._admitted = 0            # blocks admitted so far: the clock of the horizon
        self._due = _NEVER            # the admission count at which the oldest sample is due

    # -- learning from requests ---------------------------------------------------------------
    def observe_request(self, sequence_hashes: Sequence[int]) -> None:
        """Show a request's block hashes, from its first block, before its blocks are offered."""
        n = len(sequence_hashes)
        if not n:
            return
        due = self._due_before(n) if self._samples.count else ()
        known, sampled = self._seen.held_then_add(sequence_hashes)
        for sequence_hash, shown_at, kind, reused in due:     # shown again by this request?
            self._learn(kind, reused or self._seen.added_since(sequence_hash, shown_at))
        base = 2 * (_new_bucket(n - known) * 2 + (known >= 2))
        first = max(0, n - CONTEXTS)
        shown = dict.fromkeys(sequence_hashes[first:], base)
        # the request's last block; flagged if its parent is new too, so that it is not
        # kept alone when its parent is refused (without its prefix it could never hit)
        shown[sequence_hashes[-1]] = base + 1 | (_AFTER_NEW if n - known >= 2 else 0)
        for i in sampled:
            if i >= first:
                shown[sequence_hashes[i]] |= _SAMPLED
        kinds, older = self._kinds, self._older_kinds
        for h in kinds.keys() & shown.keys():               # shown again before its offer
            shown[h] = kinds[h] | _RETURNED
        for h in older.keys() & shown.keys():
            shown[h] = older.pop(h) | _RETURNED
        kinds.update(shown)
        if len(kinds) > CONTEXTS:
            self._older_kinds, self._kinds = kinds, {}

    def admit(self, sequence_hash: int) -> bool:
        packed = self._kinds.pop(sequence_hash, None)
        if packed is None:
            packed = self._older_kinds.pop(sequence_hash, None)
            if packed is None:                              # its request was not shown
                self._admitted += 1
                if self._admitted >= self._due:
                    self._expire()
                return True
        kind = packed & 31
        if packed & _RETURNED:                              # it came back before its offer
            admitted = True
            if packed & _SAMPLED:
                self._learn(kind, True)
        else:
            keep = self._keep
            admitted = keep[kind] and (not packed & _AFTER_NEW or keep[kind - 1])
            if packed & _SAMPLED:     # followed whatever the decision: being shown again
                self._follow(sequence_hash, kind)       # does not depend on being kept
        if admitted:
            self._admitted += 1
        if self._admitted >= self._due:
            self._expire()
        return admitted

    def admit_many(self, sequence_hashes: Sequence[int]) -> list[bool]:
        """:meth:`admit` of each, in order, in one pass (in C when built)."""
        ops = blockops.native()
        if ops is None:
            return [self.admit(h) for h in sequence_hashes]
        start = self._admitted
        decisions, admitted, events = ops.reuse_admit_many(
            sequence_hashes, self._kinds, self._older_kinds, bytes(self._keep))
        for position, kind, returned, before in events:
            if returned:
                self._learn(kind, True)
            else:
                self._admitted = start + before
                self._follow(sequence_hashes[position], kind)
        self._admitted = start + admitted
        if self._admitted >= self._due:
            self._expire()
        return decisions

    def reuse_rate(self, last: bool, new_blocks: int, continues: bool) -> float:
        """The learned reuse rate of one kind of block (for reports and tests)."""
        kind = 2 * (_new_bucket(new_blocks) * 2 + continues) + last
        return self._reused[kind] / self._outcomes[kind]

    # -- internals ----------------------------------------------------------------------------
    def _follow(self, sequence_hash: int, kind: int) -> None:
        samples = self._samples
        if samples.full():            # a tier that refuses nearly everything hardly moves
            self._judge(*samples.pop())                     # its clock: judge the oldest now
        samples.push(sequence_hash, self._seen.clock, self._admitted, kind)
        self._due = samples.oldest_admitted() + self._horizon

    def _judge(self, sequence_hash: int, shown_at: int, kind: int) -> None:
        """A sample's outcome: reused if a request showed it again since its offer."""
        self._learn(kind, self._seen.added_since(sequence_hash, shown_at))

    def _expire(self) -> None:
        """Judge the samples whose horizon has passed."""
        samples, oldest = self._samples, self._admitted - self._horizon
        while samples.count and samples.oldest_admitted() <= oldest:
            self._judge(*samples.pop())
        self._due = samples.oldest_admitted() + self._horizon if samples.count else _NEVER

    def _due_before(self, coming: int) -> list[tuple[int, int, int, bool]]:
        """The samples that ``coming`` more hashes would push out of the history's window,
        taken out with what the history says now (whether they were shown again); the
        caller asks again after adding the request, which may show them."""
        samples, seen, due = self._samples, self._seen, []
        last = seen.window - coming
        while samples.count and (seen.clock - samples.oldest_shown()) & 0xFFFFFFFF >= last:
            sequence_hash, shown_at, kind = samples.pop()
            due.append((sequence_hash, shown_at, kind, seen.added_since(sequence_hash, shown_at)))
        self._due = samples.oldest_admitted() + self._horizon if samples.count else _NEVER
        return due

    def _learn(self, kind: int, reused: bool) -> None:
        self._reused[kind] += reused
        self._outcomes[kind] += 1
        if self._outcomes[kind] >= WINDOW:
            self._reused[kind] = max(1, self._reused[kind] // 2)
            self._outcomes[kind] = max(2, self._outcomes[kind] // 2)
        self._keep[kind] = self._reused[kind] >= THRESHOLD * self._outcomes[kind]
