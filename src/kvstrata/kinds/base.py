"""What a kind of tier provides (:class:`Kind`), what building tiers takes
(:class:`StorageOptions`), and the rules every kind's module shares (geometry, fits in RAM).

A kind's module holds one :class:`Kind`; :mod:`kvstrata.kinds.build` asks each configured
tier's kind, in order, what is wrong with the configuration (:meth:`Kind.problems`, before
anything is allocated), then to build its storage (:meth:`Kind.build`), and, after a
restart, what it kept (:meth:`Kind.recovered_rows`, :meth:`Kind.peek_recovered`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Mapping, Sequence

from ..compat import NATIVE_BLOCK_LAYOUT, Compatibility, compatibility_of
from ..config import KvConfig, format_size
from ..physical import DeviceStorage, FileOps, LayoutConfig, PhysicalError, Storage
from ..physical.capacity import physical_memory
from ..placement.costs import CostPrior
from ..tiers import TierKind
from ..types import BlockRecord

if TYPE_CHECKING:
    from ..physical.storage.host_shared import SharedHost
    from ..physical.storage.s3client import S3Config

__all__ = ["Kind", "StorageOptions", "Storages", "TierSetupError", "RecoveredRow",
           "layout_config_for", "ram_problem"]

RecoveredRow = tuple[int, int, "int | None", int]
"""A block a durable tier kept: (slot, sequence hash, parent hash, local hash)."""


class TierSetupError(ValueError):
    """The tiers cannot be built here; ``problems`` names every reason (the message joins
    them). Raised before anything is allocated, or, for what only building can find (a
    directory another process holds, a store that refuses), with nothing left behind."""

    def __init__(self, problems: Sequence[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


@dataclass
class StorageOptions:
    """How to build the storages of a config's tiers (``KvBlockManager``'s keyword arguments;
    a connector's worker passes its own)."""

    kv_caches: Mapping | Sequence | None = None
    """The engine's KV tensors to wrap as the device tier (zero-copy)."""
    kv_layout: str = "auto"
    g1_layout: str = "outer_contiguous"
    device: object = None
    verify_host_reads: bool = True
    max_host_bytes: int | None = None
    o_direct: bool | None = None
    file_ops: FileOps | None = None
    g1: DeviceStorage | None = None
    """The device tier already wrapped by the caller (an engine connector that picks the
    layout itself); it must hold blocks of the config's size (checked)."""
    engine_kv: bool = False
    """The engine supplies the device tier's memory (an engine connector's scheduler, which
    checks the tiers before its workers wrap the engine's cache): nothing of it is
    allocated here, so nothing of it is checked against this machine's RAM."""
    durable_disk: bool = True
    """Keep the disk tier across restarts when it lives in a named directory."""
    rank: int = 0
    world_size: int = 1
    """This process's rank among the ranks a model's KV heads are split over (part of the
    fingerprint of persistent tiers and of a durable disk tier's home)."""
    disk_sync: bool = False
    """Flush data and index at every disk write (survive power loss, not only crashes)."""
    block_layout: str = NATIVE_BLOCK_LAYOUT
    """The byte order of the blocks (part of the fingerprint of persistent tiers): kvstrata's
    own, or an engine's page layout its connector names."""
    object_store: "S3Config | None" = None
    """The object tier's store, instead of the tier's ``url`` (credentials from
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` either way)."""
    secret: bytes | None = field(default=None, repr=False)
    """The deployment's secret (:mod:`kvstrata.secret`) that keys and encrypts stored
    blocks; None: from the environment."""
    follow_durable: bool = False
    """Read the durable disk tier that another process of the same ``rank`` identity writes
    (a rank holding the same bytes as the writer: an MLA model's replicated latent) instead
    of keeping one: it is followed read-only (:meth:`DiskStorage.follow`), and it must exist
    already (built by the writer)."""

    shared_host: "SharedHost | None" = None
    """Keep the host tier once for the processes holding the same bytes (an MLA model's
    replicated latent), in shared memory: this process writes it or reads the writer's
    (:mod:`kvstrata.physical.storage.host_shared`). None: a host tier of its own."""

    def compatibility(self, config: KvConfig, rank: int | None = None) -> Compatibility:
        """What makes stored blocks usable here, for ``rank`` (default :attr:`rank`)."""
        return compatibility_of(config, rank=self.rank if rank is None else rank,
                                world_size=self.world_size, block_layout=self.block_layout)


@dataclass
class Storages:
    """The storages built (by tier, fastest first), the config with the fastest tier sized
    to its storage, and the temporary directories to remove and the host RAM claims
    (:mod:`.ram_claims`) to release on close."""

    config: KvConfig
    by_tier: dict[str, Storage] = field(default_factory=dict)
    temp_dirs: list[str] = field(default_factory=list)
    claims: list = field(default_factory=list)
    kinds: dict[str, "Kind"] = field(default_factory=dict)
    """The kind that built each tier's storage."""

    def recovered_rows(self) -> dict[str, list[RecoveredRow]]:
        """Per tier that kept blocks from a previous process, (slot, sequence hash, parent
        hash, local hash) of each, oldest first."""
        out = {}
        for tier, storage in self.by_tier.items():
            rows = self.kinds[tier].recovered_rows(storage)
            if rows:
                out[tier] = rows
        return out

    def recovered(self) -> dict[str, list[tuple[int, BlockRecord]]]:
        """:meth:`recovered_rows` as (slot, record) pairs: what
        :meth:`~kvstrata.placement.Planner.restore` takes."""
        block_size = self.config.block_size
        return {tier: [(slot, BlockRecord(seq, local, parent, block_size))
                       for slot, seq, parent, local in rows]
                for tier, rows in self.recovered_rows().items()}

    def close(self) -> None:
        """Free every storage (a temporary slab is deleted, a durable one kept), the
        temporary directories and the host RAM claimed."""
        try:
            for storage in self.by_tier.values():
                storage.close()
        finally:
            for directory in self.temp_dirs:
                shutil.rmtree(directory, ignore_errors=True)
            self.temp_dirs = []
            for claim in self.claims:
                claim.release()
            self.claims = []


class Kind(ABC):
    """Everything about one kind of tier; one instance, ``KIND``, per module of
    :mod:`kvstrata.kinds`."""

    kind: ClassVar[TierKind]
    cost_prior: ClassVar[CostPrior]
    """What the cost model assumes of a copy to or from this kind before one was measured."""
    through_host: ClassVar[bool] = False
    """Whether its blocks reach the engine through host RAM (then a host tier is required)."""

    def problems(self, config: KvConfig, tier: str, options: StorageOptions,
                 ranks: int = 1) -> list[str]:
        """What stops ``tier`` from being built on this machine (settings it lacks, sizes it
        cannot hold), found without allocating anything; ``ranks`` is how many ranks, from
        ``options.rank`` on, build it here (each holds its own share of every block)."""
        return []

    @abstractmethod
    def build(self, tier: str, built: Storages, geometry: LayoutConfig | None,
              options: StorageOptions) -> Storage:
        """The storage of ``tier``; ``geometry`` is the fastest tier's (None when this is
        the fastest), which every tier shares. Raises :class:`TierSetupError`."""

    def recovered_rows(self, storage: Storage) -> list[RecoveredRow]:
        """The blocks ``storage`` kept from a previous process, oldest first (none here)."""
        return []

    def peek_recovered(self, config: KvConfig, tier: str, options: StorageOptions,
                       rank: int) -> list[RecoveredRow] | None:
        """What :meth:`build` recovers (or recovered) for ``rank``, read without touching
        the storage; None when it cannot be read from here (none kept here)."""
        return []

    def followed_exists(self, config: KvConfig, tier: str, options: StorageOptions) -> bool:
        """Whether what :meth:`build` with these ``options`` reads from another process
        (which writes it) has been made; true where it reads nothing of another's."""
        return True

    def followed_where(self, config: KvConfig, tier: str, options: StorageOptions) -> str:
        """Where :meth:`followed_exists` looks (for messages)."""
        return ""

    def open_shared(self, config: KvConfig, tier: str, options: StorageOptions,
                    rank: int) -> Storage:
        """The storage of a shared ``tier`` (addressed by keys: others write it too) as
        ``rank`` sees it, opened on its own so that a scheduler can list what others
        stored; only kinds whose tiers are shared have one."""
        raise TierSetupError(f"{tier} ({self.kind.value}) is not a shared store")


def layout_config_for(config: KvConfig, num_blocks: int, alignment: int = 1) -> LayoutConfig:
    """The physical geometry of ``num_blocks`` blocks of ``config.model``."""
    m = config.model
    try:
        return LayoutConfig(num_blocks=num_blocks, num_layers=m.num_layers,
                            outer_dim=m.outer_dim, page_size=config.block_size,
                            inner_dim=m.kv_heads * m.head_dim, dtype=m.dtype,
                            alignment=alignment)
    except PhysicalError as exc:
        raise TierSetupError(f"model geometry: {exc}") from exc


def ram_problem(what: str, need: int) -> str | None:
    """Why ``need`` bytes of RAM for ``what`` do not fit this machine (None if they do, or
    if the machine does not say how much it has)."""
    ram = physical_memory()
    if ram and need > ram:
        return (f"{what} needs {need} bytes of RAM ({format_size(need)}); this machine has "
                f"{format_size(ram)}")
    return None
