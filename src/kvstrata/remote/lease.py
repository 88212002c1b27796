"""Leases: blocks an exporter keeps still for a reader, until released or expired.

A reader asks for a prefix of sequence hashes; the exporter *pins* the longest prefix its tier
holds (a pool handle: pinned blocks are neither evicted nor rewritten) and grants a
:class:`Lease` naming, per block, its slot and the checksum of its bytes, with a deadline.
The reader releases it when its read is done; a lease never released (a reader that died,
or hung) expires at its deadline and its blocks are unpinned: nothing stays pinned forever.

:class:`LeaseTable` is the exporter's bookkeeping; ``pin`` and ``unpin`` are given by the
owner of the pool (they run wherever the pool may be touched). Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
import time
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
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pin, self._unpin = pin, unpin
        self._max = max_leases
        self._clock = clock
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._leases: dict[int, tuple[Lease, Any]] = {}
        self.expired = 0
        """Leases that reached their deadline unreleased."""

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, hashes: Sequence[int], ttl: float) -> Lease | None:
        """Pin the longest held prefix of ``hashes`` for ``ttl`` seconds (at most
        :data:`MAX_TTL`); None when not even its first block is held. Expires overdue leases
        first; :class:`LeaseError` when ``max_leases`` are outstanding."""
        if not ttl > 0:
            raise LeaseError(f"a lease lasts > 0 seconds, got {ttl!r}")
        self.expire()
        with self._lock:
            if len(self._leases) >= self._max:
                raise LeaseError(f"{self._max} leases outstanding; release some first")
        blocks, token = self._pin(list(hashes))
        if not blocks:
            if token is not None:
                self._unpin(token)
            return None
        ttl = min(float(ttl), MAX_TTL)
        lease = Lease(next(self._ids), tuple(blocks), ttl, self._clock() + ttl)
        with self._lock:
            self._leases[lease.lease_id] = (lease, token)
        return lease

    def held(self, hashes: Sequence[int]) -> int:
        """How long a prefix of ``hashes`` is held now (pinned and unpinned at once)."""
        blocks, token = self._pin(list(hashes))
        if token is not None:
            self._unpin(token)
        return len(blocks)

    def release(self, lease_id: int) -> bool:
        """Unpin a lease's blocks; False if it is unknown (released or expired already)."""
        with self._lock:
            entry = self._leases.pop(lease_id, None)
        if entry is None:
            return False
        self._unpin(entry[1])
        return True

    def expire(self) -> int:
        """Unpin every lease past its deadline; returns how many."""
        now = self._clock()
        with self._lock:
            overdue = [k for k, (lease, _) in self._leases.items() if lease.deadline <= now]
            entries = [self._leases.pop(k) for k in overdue]
        for _, token in entries:
            self._unpin(token)
        self.expired += len(entries)
        return len(entries)

    def close(self) -> None:
        """Unpin everything (the exporter is going away)."""
        with self._lock:
            entries, self._leases = list(self._leases.values()), {}
        for _, token in entries:
            self._unpin(token)
