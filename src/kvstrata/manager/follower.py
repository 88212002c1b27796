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
    says now;
  - :meth:`FollowerReader.load`: that prefix copied into the engine's block ids, verified
    (a block the writer overwrote since is reported failed and ends the prefix: never loaded
    as the block it replaced).

Only the writer's G3 is read. What the writer holds only in a G2 of kvstrata's own or in a
G4 is a miss here, and an engine that takes the shortest hit of its ranks then loads what G3
holds. Until the writer's G3 exists (the writer starts later, or restarts), everything is a
miss. Both ranks must name the blocks alike: the same config and the writer's rank.
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
from ..physical.errors import BlockFailure
from ..protocol.plans import Endpoint, TransferPlan
from ..tiers import TOP_TIER, TierKind, ordered, spec
from .block_manager import _hashes
from .engine_owned import checked_engine_ids
from .errors import ManagerClosedError, ManagerConfigError

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
                 o_direct: bool | None = None) -> None:
        disks = [t for t in ordered(config.tiers) if spec(t).kind is TierKind.DISK]
        if not disks or config.directory_of(disks[0]) is None:
            raise ManagerConfigError(
                "a rank that reads what another rank stores needs that rank's G3 in a "
                "directory (disk_dir, or the tier's path): there it finds it")
        self.config = config
        self.tier = disks[0]
        self._options = StorageOptions(kv_caches=kv_caches, kv_layout=kv_layout,
                                       rank=writer_rank, world_size=world_size, secret=secret,
                                       o_direct=o_direct)
        try:
            self._top = build_storages(replace(config, tiers={TOP_TIER: config.tiers[TOP_TIER]}),
                                       self._options)
        except TierSetupError as exc:
            raise ManagerConfigError(str(exc)) from exc
        self._disk: DiskStorage | None = None
        self._engine: TransferEngine | None = None
        self._lock = threading.Lock()
        self._jobs = itertools.count()
        self._closed = False
        self.waiting_for = ""
        """Why the writer's G3 is not read now ("" while it is)."""

    # ------------------------------------------------------------------ the verbs
    def held(self, sequence_hashes: Sequence[int]) -> int:
        """How many blocks of the longest prefix of ``sequence_hashes`` the writer's G3
        holds now (0 while it cannot be read)."""
        hashes = _hashes(sequence_hashes, "held")
        with self._lock:
            disk = self._follow()
            return 0 if disk is None else len(_prefix_slots(disk, hashes))

    def load(self, sequence_hashes: Sequence[int],
             engine_block_ids: Sequence[int]) -> FollowedLoad:
        """Copy the longest prefix of ``sequence_hashes`` the writer's G3 holds into the
        engine's ``engine_block_ids`` (one per hash), verified; the load ends at the first
        block that fails. Blocks past what is returned as loaded must not be used."""
        hashes = _hashes(sequence_hashes, "load")
        ids = checked_engine_ids(engine_block_ids, len(hashes),
                                 self.config.tier_blocks(TOP_TIER), "load")
        with self._lock:
            disk = self._follow()
            slots = [] if disk is None else _prefix_slots(disk, hashes)
            if not slots:
                return FollowedLoad(0)
            count = len(slots)
            plan = TransferPlan(next(self._jobs), Endpoint(self.tier), Endpoint(TOP_TIER),
                                tuple(hashes[:count]), src_block_ids=tuple(slots),
                                dst_block_ids=tuple(ids[:count]))
            future = self._engine.submit(plan)
        # waited for outside the lock, so that lookups do not wait for reads; closing the
        # engine (a reopen, close()) runs the plans queued before it ends
        result = future.result()
        loaded = next((i for i, ok in enumerate(result.ok) if not ok), count)
        return FollowedLoad(loaded, tuple(result.failures))

    def close(self) -> None:
        """Let go of the writer's G3 and this rank's wrap of its memory. Idempotent."""
        with self._lock:
            self._closed = True
            self._drop()
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
        self._engine = TransferEngine({TOP_TIER: self._top.by_tier[TOP_TIER], self.tier: disk})
        return disk

    def _drop(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._disk is not None:
            self._disk.close()
            self._disk = None


def _prefix_slots(disk: DiskStorage, hashes: list[int]) -> list[int]:
    """The slots of the longest prefix of ``hashes`` that ``disk`` holds."""
    slots = []
    for h in hashes:
        slot = disk.slot_of(h)
        if slot is None:
            break
        slots.append(slot)
    return slots
