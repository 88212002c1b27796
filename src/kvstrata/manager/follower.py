"""``FollowerReader``: a rank that reads the blocks another rank of the same engine stores.

Some KV is the same on every rank: an MLA model's latent cache is replicated over its
tensor-parallel ranks. Storing it once per rank would multiply disk space and writes by the
number of ranks, so it is stored once. SGLang already works this way: it backs replicated KV
up from one rank (``HiCacheStorageConfig.is_storage_writer``) and has every rank look it up
and load it, agreeing on the shortest hit of all ranks. kvstrata keeps that one copy in the
writer rank's durable G3:

* the writer rank runs a full block manager
  (:class:`~kvstrata.manager.EngineOwnedManager`) whose G3 lives in a directory;
* every other rank runs a :class:`FollowerReader` over that G3, opened read-only
  (:meth:`~kvstrata.physical.DiskStorage.follow`: it follows the writer's index journal and
  never writes), loading into its own engine memory:

  - :meth:`FollowerReader.held`: how long a prefix the writer's G3 holds, as its journal
    says now, or, for blocks it no longer holds there, its G4 (the object store every rank
    reads by the same keys);
  - :meth:`FollowerReader.load`: that prefix copied into the engine's block ids, verified
    (a block the writer overwrote since is reported failed and ends the prefix: never loaded
    as the block it replaced).

What the writer holds only in a G2 of kvstrata's own is a miss here, and an engine that takes
the shortest hit of its ranks then loads what G3 and G4 hold. Until the writer's G3 exists
(the writer starts later, or restarts), everything is a miss. Both ranks must name the
blocks alike: the same config and the writer's rank.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, replace
from typing import Sequence

from ..config import KvConfig
from ..kinds import StorageOptions, build_storages, kind_of
from ..kinds.base import TierSetupError
from ..physical import DiskStorage, TransferEngine
from ..physical.errors import BlockFailure, PhysicalError
from ..placement.keys import block_key
from ..protocol.plans import Endpoint, TransferPlan
from ..tiers import TOP_TIER, TierKind, ordered, spec
from ..types import BlockRecord
from .engine_owned import checked_engine_ids
from .errors import InvalidBlockError, ManagerClosedError, ManagerConfigError

__all__ = ["FollowerReader", "FollowedLoad"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowedLoad:
    """What :meth:`FollowerReader.load` loaded: the first ``loaded`` blocks asked for, and
    the blocks that failed (their bytes were not used)."""

    loaded: int
    failures: tuple[BlockFailure, ...] = ()

    def __len__(self) -> int:
        return self.loaded


class FollowerReader:
    """See the module docstring. ``config`` is the writer's (its G3 must have a directory);
    ``kv_caches`` / ``kv_layout`` this rank's engine memory, wrapped as G1 as
    :class:`~kvstrata.manager.EngineOwnedManager` wraps it; ``writer_rank`` and
    ``world_size`` the identity the writer stores its blocks under. Thread-safe: calls run
    one at a time."""

    def __init__(self, config: KvConfig, *, kv_caches, kv_layout: str = "block_page",
                 writer_rank: int = 0, world_size: int = 1, secret: bytes | None = None,
                 o_direct: bool | None = None, object_store=None) -> None:
        disks = [t for t in ordered(config.tiers) if spec(t).kind is TierKind.DISK]
        stores = [t for t in ordered(config.tiers) if spec(t).kind is TierKind.OBJECT]
        if not disks or config.directory_of(disks[0]) is None:
            raise ManagerConfigError(
                "a rank that reads what another rank stores needs that rank's G3 in a "
                "directory (disk_dir, or the tier's path): there it finds it")
        self.config = config
        self.tier = disks[0]
        self._options = StorageOptions(kv_caches=kv_caches, kv_layout=kv_layout,
                                       rank=writer_rank, world_size=world_size, secret=secret,
                                       o_direct=o_direct, object_store=object_store)
        try:
            self._top = build_storages(replace(config, tiers={TOP_TIER: config.tiers[TOP_TIER]}),
                                       self._options)
        except TierSetupError as exc:
            raise ManagerConfigError(str(exc)) from exc
        self.store_tier = stores[0] if stores else None
        self._objects = None
        if self.store_tier is not None:
            try:
                self._objects = kind_of(self.store_tier).open(
                    config, self.store_tier, self._options,
                    geometry=self._top.by_tier[TOP_TIER].config)
            except TierSetupError as exc:
                self._top.close()
                raise ManagerConfigError(str(exc)) from exc
        self._disk: DiskStorage | None = None
        self._engine: TransferEngine | None = None
        self._lock = threading.Lock()
        self._jobs = itertools.count()
        self._closed = False
        self.waiting_for = ""
        """Why the writer's G3 is not read now ("" while it is)."""

    # ------------------------------------------------------------------ the verbs
    def held(self, records: Sequence[BlockRecord]) -> int:
        """How many blocks of the longest prefix of ``records`` (a chain, as the writer
        stored it) the writer's G3 or G4 holds now (0 while its G3 cannot be read)."""
        records = _checked_records(records, "held")
        with self._lock:
            return len(self._sources(records))

    def load(self, records: Sequence[BlockRecord],
             engine_block_ids: Sequence[int]) -> FollowedLoad:
        """Copy the longest prefix of ``records`` the writer's G3 or G4 holds into the
        engine's ``engine_block_ids`` (one per record), verified; the load ends at the first
        block that fails. Blocks past what is returned as loaded must not be used."""
        records = _checked_records(records, "load")
        ids = checked_engine_ids(engine_block_ids, len(records),
                                 self.config.tier_blocks(TOP_TIER), "load")
        with self._lock:
            sources = self._sources(records)
            futures = []
            start = 0
            for tier, run in itertools.groupby(sources, key=lambda s: s[0]):
                where = [address for _, address in run]
                end = start + len(where)
                by = {"src_block_ids": tuple(where)} if tier == self.tier else \
                    {"src_keys": tuple(where)}
                futures.append((start, self._engine.submit(TransferPlan(
                    next(self._jobs), Endpoint(tier), Endpoint(TOP_TIER),
                    tuple(r.sequence_hash for r in records[start:end]),
                    dst_block_ids=tuple(ids[start:end]), **by))))
                start = end
            results = [(first, future.result()) for first, future in futures]
        loaded, failures = len(sources), []
        for first, result in results:
            failures.extend(result.failures)
            bad = next((i for i, ok in enumerate(result.ok) if not ok), None)
            if bad is not None:
                loaded = min(loaded, first + bad)
        return FollowedLoad(loaded, tuple(failures))

    def close(self) -> None:
        """Let go of the writer's G3 and G4 and this rank's wrap of its memory. Idempotent."""
        with self._lock:
            self._closed = True
            self._drop()
            if self._objects is not None:
                self._objects.close()
            self._top.close()

    # ------------------------------------------------------------------ helpers
    def _follow(self) -> DiskStorage | None:
        """The writer's G3, refreshed (opened on first use, reopened when the writer made a
        new one); None while there is none to read. Call with the lock held."""
        if self._closed:
            raise ManagerClosedError("the follower reader is closed")
        if self._disk is not None and self._disk.refresh():
            return self._disk
        self._drop()
        kind = kind_of(self.tier)
        try:
            if not kind.followed_exists(self.config, self.tier, self._options):
                raise TierSetupError(f"the writer has not made its {self.tier} in "
                                     f"{self.config.directory_of(self.tier)} yet")
            disk = kind.open_followed(self.config, self.tier,
                                      self._top.by_tier[TOP_TIER].config, self._options)
        except TierSetupError as exc:
            if str(exc) != self.waiting_for:
                log.info("kvstrata: not reading the writer's %s yet: %s", self.tier, exc)
            self.waiting_for = str(exc)
            return None
        self.waiting_for = ""
        self._disk = disk
        storages = {TOP_TIER: self._top.by_tier[TOP_TIER], self.tier: disk}
        if self._objects is not None:
            storages[self.store_tier] = self._objects
        self._engine = TransferEngine(storages)
        return disk

    def _sources(self, records: list[BlockRecord]) -> list[tuple[str, int | str]]:
        """Where each block of the longest prefix of ``records`` the writer holds is: (its
        G3, slot) or (its G4, key). Call with the lock held."""
        disk = self._follow()
        if disk is None:
            return []
        slots = [disk.slot_of(r.sequence_hash) for r in records]
        stored = {}
        elsewhere = [i for i, slot in enumerate(slots) if slot is None]
        if elsewhere and self._objects is not None:
            keys = [block_key(records[i]) for i in elsewhere]
            try:
                stored = {i: key for i, key, held in zip(elsewhere, keys,
                                                          self._objects.exists(keys)) if held}
            except PhysicalError as exc:      # a store that does not answer: misses
                log.warning("kvstrata: %s did not answer: %s", self.store_tier, exc)
        sources: list[tuple[str, int | str]] = []
        for i, slot in enumerate(slots):
            if slot is not None:
                sources.append((self.tier, slot))
            elif i in stored:
                sources.append((self.store_tier, stored[i]))
            else:
                break
        return sources

    def _drop(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._disk is not None:
            self._disk.close()
            self._disk = None


def _checked_records(records: Sequence[BlockRecord], what: str) -> list[BlockRecord]:
    records = list(records)
    bad = next((i for i, r in enumerate(records) if not isinstance(r, BlockRecord)), None)
    if bad is not None:
        raise InvalidBlockError(f"{what}: records[{bad}] is not a BlockRecord")
    return records
