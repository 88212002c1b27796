"""Which tiers hold which sequence hash, and the observer hook the event plane listens on.

Each tier's pool reports to one shared :class:`BlockRegistry` when a hash becomes visible in
that tier (registered) and when it stops being visible (evicted or reset). The registry keeps,
per hash, the set of tiers holding it, and tells observers:

* ``on_tier_stored`` / ``on_tier_removed`` / ``on_tier_cleared``: per-tier changes, one call per
  batch, in the order they happened (a consumer that replays them reaches the exact state);
* ``on_stored`` / ``on_removed``: the hash entered its first tier / left its last tier.

Observers run synchronously on the pool owner's thread, so they must be cheap (the event
publisher only enqueues). An observer that raises is logged and counted
(:attr:`BlockRegistry.observer_errors`) and the others still run: a failing sink must never
leave a pool half-updated. The registry is metadata only: it never touches bytes.
"""

from __future__ import annotations

import logging
from itertools import repeat
from typing import Callable, Iterable, Sequence

from ..tiers import TIER_NAMES, spec
from ..types import BlockRecord
from . import blockops

__all__ = ["BlockRegistry", "RegistryObserver", "UNOBSERVED", "BlockRecord"]

_log = logging.getLogger(__name__)

_TIER_BIT = {name: 1 << spec(name).order for name in TIER_NAMES}


class RegistryObserver:
    """Base class for registry observers; override what you need (the defaults do nothing)."""

    def on_tier_stored(self, tier: str, records: Sequence[BlockRecord]) -> None:
        """``records`` became visible in ``tier`` (in registration order, parents first)."""

    def on_tier_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        """``sequence_hashes`` stopped being visible in ``tier``."""

    def on_tier_cleared(self, tier: str) -> None:
        """Every block of ``tier`` was dropped at once (``reset_blocks`` of everything)."""

    def on_stored(self, records: Sequence[BlockRecord]) -> None:
        """``records`` entered their first tier (were held nowhere before)."""

    def on_removed(self, sequence_hashes: Sequence[int]) -> None:
        """``sequence_hashes`` left their last tier (are held nowhere now)."""


class BlockRegistry:
    """Maps each sequence hash to the tiers that hold it, and fans changes out to observers."""

    def __init__(self) -> None:
        # hash -> bit mask of the tiers holding it (bit i = the tier of order i); cheaper than
        # sets. A native HashIndex when built (12 bytes a bucket), else a dict: same mapping.
        native = blockops.native_slots()
        self._tiers_by_hash = native.HashIndex() if native is not None else {}
        self._observers: list[RegistryObserver] = []
        self.observer_errors = 0
        """How many observer calls raised (each is logged; the registry carries on)."""

    # -- observers -------------------------------------------------------------------------
    def add_observer(self, observer: RegistryObserver) -> None:
        """Start telling ``observer`` about changes (it sees only changes from now on)."""
        self._observers.append(observer)

    def remove_observer(self, observer: RegistryObserver) -> None:
        """Stop telling ``observer``; unknown observers are ignored."""
        if observer in self._observers:
            self._observers.remove(observer)

    # -- queries ---------------------------------------------------------------------------
    def tiers_of(self, sequence_hash: int) -> frozenset[str]:
        """The tiers holding ``sequence_hash`` (empty if none)."""
        mask = self._tiers_by_hash.get(sequence_hash, 0)
        return frozenset(name for name, bit in _TIER_BIT.items() if mask & bit)

    def __contains__(self, sequence_hash: int) -> bool:
        return sequence_hash in self._tiers_by_hash

    def __len__(self) -> int:
        """Number of distinct hashes held by at least one tier."""
        return len(self._tiers_by_hash)

    def hashes_in(self, tier: str) -> set[int]:
        """All hashes ``tier`` holds (O(total hashes); for tests and snapshots)."""
        bit = _TIER_BIT[tier]
        return {h for h, mask in self._tiers_by_hash.items() if mask & bit}

    # -- updates (called by pools, on the owner thread) ------------------------------------
    def record_stored(self, tier: str, records: Sequence[BlockRecord],
                      hashes: Sequence[int] | None = None) -> None:
        """Pools call this after ``records`` were registered in ``tier``; ``hashes``, if
        given, are their sequence hashes, each once (the pool has them at hand)."""
        if not records:
            return
        tiers_by_hash = self._tiers_by_hash
        bit = _TIER_BIT[tier]
        if hashes is not None and not any(map(tiers_by_hash.__contains__, hashes)):
            # All new (the common case): in bulk. A hash given twice is counted once, as below.
            for h in hashes:
                tiers_by_hash[h] = bit
            first_seen = list(records)
            for observer in self._observers:
                self._notify(observer.on_tier_stored, tier, records)
                self._notify(observer.on_stored, first_seen)
            return
        first_seen: list[BlockRecord] = []
        for record in records:
            h = record.sequence_hash
            mask = tiers_by_hash.get(h)
            if mask is None:
                tiers_by_hash[h] = bit
                first_seen.append(record)
            else:
                tiers_by_hash[h] = mask | bit
        for observer in self._observers:
            self._notify(observer.on_tier_stored, tier, records)
            if first_seen:
                self._notify(observer.on_stored, first_seen)

    def bulk_target(self, tier: str) -> tuple[dict[int, int] | None, int]:
        """For a pool registering in bulk: this registry's map and ``tier``'s bit. A pool
        that adds a batch of hashes none of which the map holds (``tiers[h] = bit``) then
        calls :meth:`stored_new`; otherwise :meth:`record_stored`."""
        return self._tiers_by_hash, _TIER_BIT[tier]

    def stored_new(self, tier: str, records: Sequence[BlockRecord]) -> None:
        """``records`` were registered in ``tier`` and, being held by no tier before, were
        added to the map by the pool (see :meth:`bulk_target`): tell the observers."""
        if not records or not self._observers:
            return
        first_seen = list(records)
        for observer in self._observers:
            self._notify(observer.on_tier_stored, tier, records)
            self._notify(observer.on_stored, first_seen)

    def record_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        """Pools call this after ``sequence_hashes`` stopped being visible in ``tier``."""
        if not sequence_hashes:
            return
        gone = self._drop_tier(tier, sequence_hashes)
        for observer in self._observers:
            self._notify(observer.on_tier_removed, tier, sequence_hashes)
            if gone:
                self._notify(observer.on_removed, gone)

    def _drop_tier(self, tier: str, sequence_hashes: Iterable[int]) -> list[int]:
        """Remove ``tier`` from each hash; returns the hashes now held by no tier."""
        gone: list[int] = []
        tiers_by_hash = self._tiers_by_hash
        bit = _TIER_BIT[tier]
        keep = ~bit
        if isinstance(sequence_hashes, list):
            # Common case in bulk: every hash held by this tier alone, each given once.
            masks = list(map(tiers_by_hash.pop, sequence_hashes, repeat(None)))
            if masks.count(bit) == len(masks):
                return list(sequence_hashes)
            for h, mask in zip(sequence_hashes, masks):   # put back, then the general way
                if mask is not None:
                    tiers_by_hash[h] = mask
        for h in sequence_hashes:
            mask = tiers_by_hash.get(h)
            if mask is None:
                continue
            mask &= keep
            if mask:
                tiers_by_hash[h] = mask
            else:
                del tiers_by_hash[h]
                gone.append(h)
        return gone

    def record_cleared(self, tier: str, sequence_hashes: Iterable[int]) -> None:
        """Pools call this after dropping every block of ``tier`` (``sequence_hashes`` held)."""
        gone = self._drop_tier(tier, sequence_hashes)
        for observer in self._observers:
            self._notify(observer.on_tier_cleared, tier)
            if gone:
                self._notify(observer.on_removed, gone)

    def _notify(self, hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:  # an observer's failure must not corrupt the pools
            self.observer_errors += 1
            _log.exception("registry observer %r failed", hook)


class _UnobservedRegistry(BlockRegistry):
    """A registry that records nothing, for pools nobody observes (the shadow caches of the
    adaptive policies): it saves the bookkeeping and accepts any pool name."""

    def record_stored(self, tier: str, records: Sequence[BlockRecord],
                      hashes: Sequence[int] | None = None) -> None:
        pass

    def bulk_target(self, tier: str) -> tuple[dict[int, int] | None, int]:
        return None, 0

    def stored_new(self, tier: str, records: Sequence[BlockRecord]) -> None:
        pass

    def record_removed(self, tier: str, sequence_hashes: Sequence[int]) -> None:
        pass

    def record_cleared(self, tier: str, sequence_hashes: Iterable[int]) -> None:
        pass

    def add_observer(self, observer: RegistryObserver) -> None:
        raise TypeError("UNOBSERVED records nothing; give the pool a BlockRegistry to observe it")


UNOBSERVED: BlockRegistry = _UnobservedRegistry()
"""Pass as a pool's ``registry`` when nothing needs to know what the pool holds."""
