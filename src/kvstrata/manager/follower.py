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
    says now, or, for blocks it no longer holds there, its G4 (the object store), as the last
    listing of the writer's namespace said (every ``list_interval`` seconds, on a thread of
    its own: a lookup never waits for the store);
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
import time
from dataclasses import dataclass, replace
from typing import Sequence

from ..config import KvConfig
from ..kinds import StorageOptions, build_storages, kind_of
from ..kinds.base import TierSetupError
from ..physical import DiskStorage, TransferEngine
from ..physical.errors import BlockFailure, FailureKind
from ..placement.keys import block_key
from ..protocol.plans import Endpoint, TransferPlan
from ..tiers import TOP_TIER, TierKind, ordered, spec
from .block_manager import _hashes
from .catalog import StoreLister
from .engine_owned import checked_engine_ids
from .errors import ManagerClosedError, ManagerConfigError

__all__ = ["FollowerReader", "FollowedLoad", "BAD_KEYS_KEPT"]

BAD_KEYS_KEPT = 100_000
"""Objects that failed their check a follower remembers not to count (about 5 MB)."""

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
                 o_direct: bool | None = None, object_store=None,
                 list_interval: float = 10.0) -> None:
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
        self._catalog: dict[int, str] = {}
        """The writer's G4 as last listed: sequence hash -> object key."""
        self._bad: dict[str, None] = {}
        """Keys of objects that failed their check here: never counted again (the writer
        does not rewrite an object it holds). At most :data:`BAD_KEYS_KEPT`, oldest out."""
        self._stop = threading.Event()
        self._listing: threading.Thread | None = None
        if self.store_tier is not None:
            try:
                self._objects = kind_of(self.store_tier).open(
                    config, self.store_tier, self._options,
                    geometry=self._top.by_tier[TOP_TIER].config)
            except TierSetupError as exc:
                self._top.close()
                raise ManagerConfigError(str(exc)) from exc
            lister = StoreLister(self._objects, self.store_tier, config.block_size,
                                 lambda tier, records: None, None,
                                 limit=config.tier_blocks(self.store_tier))
            self._listing = threading.Thread(target=self._list_store,
                                             args=(lister, list_interval), daemon=True,
                                             name=f"kvstrata-follow-{self.store_tier}")
            self._listing.start()
        self._disk: DiskStorage | None = None
        self._engine: TransferEngine | None = None
        self._lock = threading.Lock()
        self._jobs = itertools.count()
        self._closed = False
        self.waiting_for = ""
        """Why the writer's G3 is not read now ("" while it is)."""

    # ------------------------------------------------------------------ the verbs
    def held(self, sequence_hashes: Sequence[int]) -> int:
        """How many blocks of the longest prefix of ``sequence_hashes`` the writer's G3 or
        G4 holds now (0 while its G3 cannot be read)."""
        hashes = _hashes(sequence_hashes, "held")
        with self._lock:
            return len(self._sources(hashes))

    def load(self, sequence_hashes: Sequence[int],
             engine_block_ids: Sequence[int]) -> FollowedLoad:
        """Copy the longest prefix of ``sequence_hashes`` the writer's G3 or G4 holds into
        the engine's ``engine_block_ids`` (one per hash), verified; the load ends at the
        first block that fails. Blocks past what is returned as loaded must not be used."""
        hashes = _hashes(sequence_hashes, "load")
        ids = checked_engine_ids(engine_block_ids, len(hashes),
                                 self.config.tier_blocks(TOP_TIER), "load")
        with self._lock:
            sources = self._sources(hashes)
            runs = []
            start = 0
            for tier, run in itertools.groupby(sources, key=lambda s: s[0]):
                where = [address for _, address in run]
                end = start + len(where)
                by = {"src_block_ids": tuple(where)} if tier == self.tier else \
                    {"src_keys": tuple(where)}
                runs.append((start, self._engine.submit(TransferPlan(
                    next(self._jobs), Endpoint(tier), Endpoint(TOP_TIER),
                    tuple(hashes[start:end]), dst_block_ids=tuple(ids[start:end]), **by))))
                start = end
            results = [(first, future.result()) for first, future in runs]
        loaded, failures = len(sources), []
        for first, result in results:
            for failure in result.failures:        # positions in the whole request
                failures.append(replace(failure, position=first + failure.position))
                if result.plan.src_keys:
                    self._forget_object(hashes[first + failure.position],
                                        result.plan.src_keys[failure.position],
                                        failure.kind in (FailureKind.CHECKSUM_MISMATCH,
                                                         FailureKind.HASH_MISMATCH))
            bad = next((i for i, ok in enumerate(result.ok) if not ok), None)
            if bad is not None:
                loaded = min(loaded, first + bad)
        return FollowedLoad(loaded, tuple(failures))

    def close(self) -> None:
        """Let go of the writer's G3 and G4 and this rank's wrap of its memory. Idempotent."""
        self._stop.set()
        if self._listing is not None:
            self._listing.join(timeout=30)      # a listing in flight ends with its timeouts
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

    def _sources(self, hashes: list[int]) -> list[tuple[str, int | str]]:
        """Where each block of the longest prefix of ``hashes`` the writer holds is: (its
        G3, slot) or (its G4, key). Call with the lock held."""
        disk = self._follow()
        if disk is None:
            return []
        catalog = self._catalog
        sources: list[tuple[str, int | str]] = []
        for h in hashes:
            slot = disk.slot_of(h)
            if slot is not None:
                sources.append((self.tier, slot))
            elif h in catalog:
                sources.append((self.store_tier, catalog[h]))
            else:
                break
        return sources

    def _forget_object(self, sequence_hash: int, key: str, bad: bool) -> None:
        """An object failed to load: gone or unreadable now (not counted until a listing
        finds it again), or ``bad`` (it failed its check: never counted again)."""
        self._catalog.pop(sequence_hash, None)
        if bad:
            self._bad[key] = None
            while len(self._bad) > BAD_KEYS_KEPT:
                del self._bad[next(iter(self._bad))]

    def _list_store(self, lister: StoreLister, interval: float) -> None:
        """List the writer's G4 namespace now and every ``interval`` seconds, replacing the
        catalog each time (a store that does not answer keeps the last one)."""
        warned = float("-inf")
        while not self._stop.is_set():
            try:
                records = lister.records()
            except Exception as exc:           # down or refusing: try again later
                if time.monotonic() - warned > 60:
                    warned = time.monotonic()
                    log.warning("kvstrata: cannot list the writer's %s (%s)", self.store_tier,
                                exc)
            else:
                bad = self._bad
                self._catalog = {r.sequence_hash: key for r in records
                                 if (key := block_key(r)) not in bad}
            if self._stop.wait(interval):
                return

    def _drop(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._disk is not None:
            self._disk.close()
            self._disk = None
