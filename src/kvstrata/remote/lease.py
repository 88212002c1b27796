"""Leases: blocks an exporter keeps still for a reader, until released or expired.

A reader asks for a prefix of sequence hashes; the exporter *pins* the longest prefix its tier
holds (a pool handle: pinned blocks are neither evicted nor rewritten) and grants a
:class:`Lease` naming, per block, its slot and the checksum of its bytes, with a deadline.
The reader releases it when its read is done; a lease never released (a reader that died,
or hung) expires at its deadline and its blocks are unpinned: nothing stays pinned forever.

:class:`LeaseTable` is the exporter's bookkeeping; ``pin`` and ``unpin`` are given by the
owner of the pool (they run wherever the pool may be touched). Thread-safe.

A lease belongs to whoever took it (the exporter passes the control connection): its id is
random (63 bits, not a count another reader could guess), only its owner releases it (for
anyone else it does not exist), and an owner's leases go when it does
(:meth:`LeaseTable.release_owner`: the connection closed). Caps count per *group* of owners
(the exporter passes the remote host): one host holds at most ``max_per_owner`` leases and
``max_blocks_per_owner`` pinned blocks, however many connections it opens, and all leases
together pin at most ``max_blocks`` (the exporter passes shares of its tier), so one reader
cannot take the table from the others, and readers cannot pin the whole tier (its owner
could then store nothing new). A lease that would pass a block cap is cut to the prefix
that fits.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import LeaseError

__all__ = ["Lease", "LeaseTable", "MAX_TTL"]

MAX_TTL = 300.0
"""Longest lease granted, seconds (a reader asking more gets this)."""


@dataclass(frozen=True)
class Lease:
    """A granted lease: ``blocks`` are ``(sequence_hash, slot, checksum)`` of the pinned
    prefix, valid until ``deadline`` (the exporter's monotonic clock) or released."""

    lease_id: int
    blocks: tuple[tuple[int, int, int], ...]
    ttl: float
    deadline: float


class LeaseTable:
    """Leases granted and not yet released or expired (see the module docstring).
    ``pin(hashes) -> (blocks, token)`` pins the longest held prefix of ``hashes`` and returns
    its ``(hash, slot, checksum)`` rows and a token; ``unpin(token)`` undoes it."""

    def __init__(self, pin: Callable[[Sequence[int]], tuple[list[tuple[int, int, int]], Any]],
                 unpin: Callable[[Any], None], max_leases: int = 1024,
                 clock: Callable[[], float] = time.monotonic, *, max_per_owner: int = 64,
                 max_blocks_per_owner: int = 1 << 18, max_blocks: int = 1 << 20) -> None:
        self._pin, self._unpin = pin, unpin
        self._max = max_leases
        self._max_per_owner, self._max_blocks_per_owner = max_per_owner, max_blocks_per_owner
        self._max_blocks = max_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[int, tuple[Lease, Any, Any, Any]] = {}
        """lease id -> (lease, pin token, owner, the owner's group)."""
        self._pinned: Counter[int] = Counter()
        self._pinned_by_group: dict[Any, Counter[int]] = {}
        """Slots pinned (a slot pinned by two leases once) and the leases pinning each, in
        all and per group."""
        self.expired = 0
        """Leases that reached their deadline unreleased."""

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, hashes: Sequence[int], ttl: float, owner: Any = None,
              group: Any = None) -> Lease | None:
        """Pin the longest held prefix of ``hashes`` for ``ttl`` seconds (at most
        :data:`MAX_TTL`) for ``owner`` (of ``group``); None when not even its first block is
        held, at most as many blocks as the caps leave room for. Expires overdue leases
        first; :class:`LeaseError` when ``max_leases`` are outstanding, the group holds
        ``max_per_owner`` leases, or a block cap leaves no room."""
        if not ttl > 0:
            raise LeaseError(f"a lease lasts > 0 seconds, got {ttl!r}")
        self.expire()
        with self._lock:
            self._check_count(group)
        hashes = list(hashes)
        blocks, token = self._pin(hashes)
        if blocks:
            with self._lock:
                fit = self._fitting(blocks, group)
            if fit == 0:
                self._unpin(token)
                raise LeaseError("no block may be pinned now (this reader's host, or all "
                                 "readers together, pin as many as the exporter lets "
                                 "them); release some first")
            if fit < len(blocks):         # pinned as one handle: pin the prefix that fits
                self._unpin(token)
                blocks, token = self._pin(hashes[:fit])
        if not blocks:
            if token is not None:
                self._unpin(token)
            return None
        ttl = min(float(ttl), MAX_TTL)
        with self._lock:
            lease_id = secrets.randbits(63) or 1
            while lease_id in self._leases:
                lease_id = secrets.randbits(63) or 1
            lease = Lease(lease_id, tuple(blocks), ttl, self._clock() + ttl)
            self._leases[lease_id] = (lease, token, owner, group)
            slots = [row[1] for row in lease.blocks]
            self._pinned.update(slots)
            self._pinned_by_group.setdefault(group, Counter()).update(slots)
        return lease

    def _check_count(self, group: Any) -> None:
        """LeaseError if no lease, or none more for ``group``, may be granted now."""
        if len(self._leases) >= self._max:
            raise LeaseError(f"{self._max} leases outstanding; release some first")
        mine = sum(1 for _, _, _, g in self._leases.values() if g == group)
        if mine >= self._max_per_owner:
            raise LeaseError(f"this reader's host holds {mine} leases, the most one may; "
                             f"release some first")

    def _fitting(self, rows: Sequence[tuple[int, int, int]], group: Any) -> int:
        """How many of pinned ``rows`` fit the block caps: a slot some lease (of ``group``,
        for its own cap) pins already costs nothing more."""
        mine = self._pinned_by_group.get(group, Counter())
        room_mine = self._max_blocks_per_owner - len(mine)
        room_all = self._max_blocks - len(self._pinned)
        seen: set[int] = set()
        for end, (_, slot, _) in enumerate(rows):
            if slot in seen:
                continue
            seen.add(slot)
            room_mine -= slot not in mine
            room_all -= slot not in self._pinned
            if room_mine < 0 or room_all < 0:
                return end
        return len(rows)

    def held(self, hashes: Sequence[int]) -> int:
        """How long a prefix of ``hashes`` is held now (pinned and unpinned at once)."""
        blocks, token = self._pin(list(hashes))
        if token is not None:
            self._unpin(token)
        return len(blocks)

    def release(self, lease_id: int, owner: Any = None) -> bool:
        """Unpin a lease's blocks; False if ``owner`` holds no such lease (released,
        expired, or another reader's: which, is not said)."""
        with self._lock:
            entry = self._leases.get(lease_id)
            if entry is None or entry[2] != owner:
                return False
            self._pop([lease_id])
        self._unpin(entry[1])
        return True

    def holds(self, owner: Any) -> bool:
        """Whether ``owner`` holds a lease (expired ones go at the next :meth:`expire`)."""
        with self._lock:
            return any(entry[2] == owner for entry in self._leases.values())

    def release_owner(self, owner: Any) -> int:
        """Unpin every lease ``owner`` holds (it went away); returns how many."""
        with self._lock:
            entries = self._pop([k for k, entry in self._leases.items() if entry[2] == owner])
        for entry in entries:
            self._unpin(entry[1])
        return len(entries)

    def expire(self) -> int:
        """Unpin every lease past its deadline; returns how many."""
        now = self._clock()
        with self._lock:
            entries = self._pop([k for k, entry in self._leases.items()
                                 if entry[0].deadline <= now])
        for entry in entries:
            self._unpin(entry[1])
        self.expired += len(entries)
        return len(entries)

    def close(self) -> None:
        """Unpin everything (the exporter is going away)."""
        with self._lock:
            entries = self._pop(list(self._leases))
        for entry in entries:
            self._unpin(entry[1])

    def _pop(self, lease_ids: list[int]) -> list[tuple[Lease, Any, Any, Any]]:
        """Forget these leases and what they pin (under the lock); their entries."""
        entries = [self._leases.pop(k) for k in lease_ids]
        for lease, _, _, group in entries:
            slots = [row[1] for row in lease.blocks]
            self._pinned.subtract(slots)
            mine = self._pinned_by_group[group]
            mine.subtract(slots)
            for slot in slots:
                if self._pinned[slot] <= 0:
                    del self._pinned[slot]
                if mine[slot] <= 0:
                    del mine[slot]
            if not mine:
                del self._pinned_by_group[group]
        return entries
