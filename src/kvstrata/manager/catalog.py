"""A worker's view of a shared object tier: which blocks the store holds.

Other workers put blocks into the store too. :class:`StoreLister` lists the store's keys
(each names a block's whole identity, :mod:`kvstrata.placement.keys`) -- for a model split
over several ranks, every rank's namespace, keeping the blocks all of them hold -- and hands
the blocks to
``learn`` -- the planner's :meth:`~kvstrata.placement.Planner.learn`, on its owner's thread --
once at start and then every ``interval`` seconds from a daemon thread, so a worker that
starts empty finds what others stored, and keeps finding what they store later. A listing
that fails (the store is down) is logged, at most once a minute, and retried at the next
interval; it never stops the worker.

Anyone with the bucket's credentials can write names too, so a listing keeps only block keys
(others neither count toward its ``limit`` nor cost memory), passes over keys whose object
this worker already found bad (:meth:`ObjectStorage.found_bad`), and hands on one key per
sequence hash: one whose hashes follow the chaining rule
(:func:`~kvstrata.placement.keys.chain_consistent`) if any does, else each in turn from one
listing to the next, so a bad key cannot shadow a good one for good. Every other rank's
namespace is read only as far as the first rank's last key, keeping only the keys the first
one listed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from ..physical.storage.objects import ObjectStorage
from ..placement.keys import chain_consistent, parse_block_key
from ..types import BlockRecord

__all__ = ["StoreLister"]

log = logging.getLogger(__name__)


class StoreLister:
    """Lists ``storage`` (or every rank's storage of a list) for ``tier`` and passes what it
    finds to ``learn(tier, records)``."""

    def __init__(self, storage: ObjectStorage | Sequence[ObjectStorage], tier: str,
                 block_size: int,
                 learn: Callable[[str, list[BlockRecord]], object],
                 interval: float | None = 10.0, limit: int | None = None) -> None:
        self.storages = [storage] if isinstance(storage, ObjectStorage) else list(storage)
        self.tier = tier
        self.block_size = block_size
        self._learn = learn
        self.interval = interval
        self.limit = limit
        """At most this many keys are read per listing (the catalog holds no more)."""
        self.listings = 0
        self.failures = 0
        self._warned = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def records(self) -> list[BlockRecord]:
        """The blocks the store holds now, in every rank's namespace, one record per
        sequence hash (raises the store's error if a listing fails)."""
        first, *others = self.storages
        keys = first.list_keys(self.limit, accept=self._usable)
        for storage in others:
            if not keys:
                break
            wanted = set(keys)
            present = set(storage.list_keys(accept=wanted.__contains__, last=keys[-1]))
            keys = [k for k in keys if k in present]
        candidates: dict[int, list[BlockRecord]] = {}
        for key in keys:
            record = parse_block_key(key, self.block_size)
            candidates.setdefault(record.sequence_hash, []).append(record)
        out = []
        for named in candidates.values():
            if len(named) > 1:
                named = [r for r in named if chain_consistent(r)] or named
            out.append(named[self.listings % len(named)])
        return out

    def _usable(self, key: str) -> bool:
        return (parse_block_key(key, self.block_size) is not None
                and not any(s.found_bad(key) for s in self.storages))

    def refresh(self, learn: Callable[[str, list[BlockRecord]], object] | None = None) -> int:
        """List once and hand the result to ``learn`` (default: the one given at
        construction); the number of blocks listed (0 if the listing failed)."""
        try:
            records = self.records()
        except Exception as exc:       # the store is down or refuses: try again later
            self.failures += 1
            now = time.monotonic()
            if now - self._warned > 60:
                self._warned = now
                log.warning("kvstrata: cannot list %s (%s); %d listing(s) failed so far",
                            self.tier, exc, self.failures)
            return 0
        self.listings += 1
        if records:
            (learn or self._learn)(self.tier, records)
        return len(records)

    def start(self) -> None:
        """Refresh every ``interval`` seconds from a daemon thread (no-op without one)."""
        if not self.interval or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvstrata-{self.tier}-lister")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def close(self, *, storages: bool = False) -> None:
        """Stop refreshing (waits for a listing in progress); with ``storages``, close the
        storages too (a lister that opened its own). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if storages:
            for storage in self.storages:
                storage.close()
