"""The storage behind each configured tier of a ``KvBlockManager``, chosen by the tier's kind.

* **device** (G1): the engine's KV tensors wrapped zero-copy, or a freshly allocated region
  (a CPU tensor stands in without a GPU). Its block count is G1's size.
* **host** (G2): host RAM, each block's stride aligned to 4 KiB so the disk tier can read and
  write host slots in place with O_DIRECT.
* **disk** (G3): one slab file. In a directory the config or the caller names, it is
  *durable* (:meth:`~kvstrata.physical.DiskStorage.durable`): it lives in a home named by the
  compatibility fingerprint of the blocks (:mod:`kvstrata.compat`) and this rank, locked for
  this process, and what a previous process stored there is recovered
  (:meth:`Storages.recovered`). Without a directory (or with ``durable_disk=False``) it is a
  temporary slab removed on close. Disk blocks move through host RAM, so a disk tier needs a
  host tier.

* **object** (G4): an S3-compatible bucket shared by workers (``tiers.G4.url`` or
  ``StorageOptions.object_store``), under the namespace ``kvstrata/<fingerprint>/<tenant>/``
  so incompatible models and other tenants never read each other's blocks. Its blocks move
  through host RAM too.

A tier kind with no backend here (remote memory) is refused with
:class:`~kvstrata.manager.errors.ManagerConfigError`: adding one is a storage class plus a case
in :func:`build_storages` (and its copy handlers in the transfer engine).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from ..compat import NATIVE_BLOCK_LAYOUT, compatibility_of
from ..config import KvConfig
from ..physical import (DeviceStorage, DiskStorage, FileOps, HostStorage, LayoutConfig,
                        PhysicalError, Storage)
from ..physical.capacity import free_disk_bytes, physical_memory
from ..physical.leftovers import owner_tag, reclaim
from ..physical.storage.disk import slab_stride
from ..physical.storage.disk_home import home_name
from ..physical.storage.disk_index import DiskIndex
from ..physical.storage.objects import ObjectStorage
from ..physical.storage.s3client import ObjectStoreTransientError, S3Config
from ..tiers import TierKind, first_of_kind, ordered, spec
from ..types import BlockRecord
from .errors import ManagerConfigError

log = logging.getLogger(__name__)

__all__ = ["HOST_ALIGNMENT", "MANAGED_KINDS", "StorageOptions", "Storages", "build_storages",
           "layout_config_for", "peek_recovered", "object_namespace", "object_store_of",
           "open_object_storage", "kept_disk_bytes"]

HOST_ALIGNMENT = 4096
"""Host block stride alignment: lets the disk read and write host slots in place (O_DIRECT)."""


def layout_config_for(config: KvConfig, num_blocks: int, alignment: int = 1) -> LayoutConfig:
    """The physical geometry of ``num_blocks`` blocks of ``config.model``."""
    m = config.model
    try:
        return LayoutConfig(num_blocks=num_blocks, num_layers=m.num_layers,
                            outer_dim=m.outer_dim, page_size=config.block_size,
                            inner_dim=m.kv_heads * m.head_dim, dtype=m.dtype,
                            alignment=alignment)
    except PhysicalError as exc:
        raise ManagerConfigError(f"model geometry: {exc}") from exc


@dataclass
class StorageOptions:
    """How to build the storages (``KvBlockManager``'s keyword arguments)."""

    kv_caches: Mapping | Sequence | None = None
    kv_layout: str = "auto"
    g1_layout: str = "outer_contiguous"
    device: object = None
    disk_dir: str | None = None
    verify_host_reads: bool = False
    max_host_bytes: int | None = None
    o_direct: bool | None = None
    file_ops: FileOps | None = None
    g1: DeviceStorage | None = None
    """G1 already wrapped by the caller (an engine connector that picks the layout itself);
    it must hold blocks of the config's size (checked)."""
    durable_disk: bool = True
    """Keep the disk tier across restarts when it lives in a named directory."""
    rank: int = 0
    world_size: int = 1
    """This process's rank among the ranks a model's KV heads are split over (part of the
    durable disk tier's fingerprint and home)."""
    disk_sync: bool = False
    """Flush data and index at every disk write (survive power loss, not only crashes)."""
    block_layout: str = NATIVE_BLOCK_LAYOUT
    """The byte order of the blocks (part of the fingerprint of persistent tiers): kvstrata's
    own, or an engine's page layout its connector names."""
    object_store: "S3Config | None" = None
    """The object tier's store, instead of the tier's ``url`` (credentials from
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` either way)."""


@dataclass
class Storages:
    """The storages built, the config with G1 sized to its storage, and a temporary
    directory to remove on close (None if the caller's directory is used)."""

    config: KvConfig
    by_tier: dict[str, Storage] = field(default_factory=dict)
    temp_dir: str | None = None

    def recovered_rows(self) -> dict[str, list[tuple[int, int, int | None, int]]]:
        """Per durable tier, (slot, sequence hash, parent hash, local hash) of every block
        recovered at start, oldest first."""
        out = {}
        for tier, storage in self.by_tier.items():
            live = getattr(storage, "recovered", None)
            if live:
                out[tier] = live.rows()
        return out

    def recovered(self) -> dict[str, list[tuple[int, BlockRecord]]]:
        """:meth:`recovered_rows` as (slot, record) pairs: what
        :meth:`~kvstrata.placement.Planner.restore` takes."""
        block_size = self.config.block_size
        return {tier: [(slot, BlockRecord(seq, local, parent, block_size))
                       for slot, seq, parent, local in rows]
                for tier, rows in self.recovered_rows().items()}

    def close(self) -> None:
        """Free every storage (a temporary slab is deleted, a durable one kept) and the
        temporary directory."""
        for storage in self.by_tier.values():
            storage.close()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def build_storages(config: KvConfig, options: StorageOptions) -> Storages:
    """One storage per configured tier, fastest first; on error nothing is left behind."""
    tiers = ordered(config.tiers)
    unsupported = [t for t in tiers if spec(t).kind not in _BUILDERS]
    if unsupported:
        raise ManagerConfigError(
            f"KvBlockManager has no storage for tier(s) {', '.join(unsupported)} "
            f"({', '.join(spec(t).kind.value for t in unsupported)}) yet; it manages "
            f"{', '.join(k.value for k in _BUILDERS)} tiers")
    if spec(tiers[0]).kind is not TierKind.DEVICE:
        raise ManagerConfigError(f"the fastest tier must be device memory, got {tiers[0]}")
    kinds = {spec(t).kind for t in tiers}
    for kind in (TierKind.DISK, TierKind.OBJECT):
        if kind in kinds and TierKind.HOST not in kinds:
            lower, host = first_of_kind(kind), first_of_kind(TierKind.HOST)
            raise ManagerConfigError(f"tier {lower} ({kind.value}) needs tier {host} (host): "
                                     f"its blocks move through host RAM")
    built = Storages(config)
    try:
        geometry: LayoutConfig | None = None
        for tier in tiers:
            storage = _BUILDERS[spec(tier).kind](built, tier, geometry, options)
            built.by_tier[tier] = storage
            if geometry is None:
                geometry = storage.config
                if geometry.num_blocks != config.tier_blocks(tier):
                    sized = dict(config.tiers)
                    sized[tier] = replace(sized[tier], blocks=geometry.num_blocks, bytes=None)
                    built.config = replace(config, tiers=sized)
    except BaseException:
        built.close()
        raise
    return built


def _device(built: Storages, tier: str, _geometry, options: StorageOptions) -> Storage:
    config = built.config
    if options.g1 is not None:
        got = options.g1.config
        if got.page_size != config.block_size or got.block_bytes != config.bytes_per_block:
            raise ManagerConfigError(
                f"{tier}: the engine's KV blocks hold {got.page_size} tokens in "
                f"{got.block_bytes} bytes; the config says {config.block_size} tokens in "
                f"{config.bytes_per_block} bytes")
        return options.g1
    try:
        if options.kv_caches is not None:
            storage = DeviceStorage.wrap(options.kv_caches, kv_layout=options.kv_layout)
            _check_kv_caches(storage.config, config)
            return storage
        geometry = layout_config_for(config, config.tier_blocks(tier))
        if options.device is None or str(options.device).startswith("cpu"):
            _fits_in_ram(tier, geometry.num_blocks * geometry.block_bytes)   # a CPU stand-in
        return DeviceStorage.allocate(geometry, device=options.device,
                                      kv_layout=options.g1_layout)
    except PhysicalError as exc:
        raise ManagerConfigError(f"{tier}: {exc}") from exc


def _host(built: Storages, tier: str, geometry: LayoutConfig, options: StorageOptions
          ) -> Storage:
    cfg = geometry.with_blocks(built.config.tier_blocks(tier)).with_alignment(HOST_ALIGNMENT)
    need = cfg.num_blocks * -(-cfg.block_bytes // HOST_ALIGNMENT) * HOST_ALIGNMENT
    limit = options.max_host_bytes
    if limit is not None and need > limit:
        raise ManagerConfigError(
            f"{tier} of {cfg.num_blocks} blocks needs {need / 2**30:.2f} GiB of host RAM, "
            f"over the limit of {limit / 2**30:.2f} GiB; shrink tier {tier}")
    _fits_in_ram(tier, need)
    return HostStorage(cfg, verify_reads=options.verify_host_reads)


def _disk(built: Storages, tier: str, geometry: LayoutConfig, options: StorageOptions
          ) -> Storage:
    config = built.config
    directory = options.disk_dir or config.disk_dir or config.tiers[tier].path
    if directory is None:
        prefix = f"kvstrata-{tier.lower()}-"
        reclaim(tempfile.gettempdir(), prefix)            # left by killed processes
        directory = built.temp_dir = tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-")
    durable = options.durable_disk and built.temp_dir is None
    compat = compatibility_of(config, rank=options.rank, world_size=options.world_size,
                              block_layout=options.block_layout)
    need = config.tier_blocks(tier) * slab_stride(geometry)
    if durable:    # the slab we would reuse is already on the disk
        need -= _existing_bytes(directory, tier, options.rank, compat.fingerprint)
    free = free_disk_bytes(directory)
    if free is not None and need > free:
        raise ManagerConfigError(f"tier {tier} needs {need} bytes of disk ({need / 2**30:.2f} "
                                 f"GiB); {directory} has {free / 2**30:.2f} GiB free")
    layout = geometry.with_blocks(config.tier_blocks(tier))
    try:
        if durable:
            return DiskStorage.durable(layout, directory, fingerprint=compat.fingerprint,
                                       rank=options.rank, describe=compat.describe(),
                                       sync=options.disk_sync, name=tier.lower(),
                                       o_direct=options.o_direct, file_ops=options.file_ops)
        return DiskStorage(layout, directory, o_direct=options.o_direct,
                           file_ops=options.file_ops)
    except PhysicalError as exc:
        raise ManagerConfigError(f"{tier} in {directory}: {exc}") from exc


def peek_recovered(config: KvConfig, *, rank: int = 0, world_size: int = 1,
                   block_layout: str = NATIVE_BLOCK_LAYOUT
                   ) -> dict[str, list[tuple[int, int, int | None, int]]] | None:
    """What :func:`build_storages` recovers (or recovered) for ``rank``'s durable disk
    tiers, read from their index files without touching them: (slot, sequence hash, parent
    hash, local hash) rows per tier. None when a durable tier's index is not readable here
    (another machine, nothing stored yet). For a scheduler that does not build the storages
    itself but must know at start what its workers hold."""
    out: dict[str, list[tuple[int, int, int | None, int]]] = {}
    for tier in ordered(config.tiers):
        if spec(tier).kind is not TierKind.DISK:
            continue
        directory = config.disk_dir or config.tiers[tier].path
        if directory is None:
            continue                              # a temporary slab: nothing kept
        compat = compatibility_of(config, rank=rank, world_size=world_size,
                                  block_layout=block_layout)
        layout = layout_config_for(config, config.tier_blocks(tier))
        live = DiskIndex.peek(os.path.join(directory, home_name(tier, rank, compat.fingerprint),
                                           "index"),
                              capacity=layout.num_blocks, fingerprint=compat.fingerprint,
                              stride=slab_stride(layout))
        if live is None:
            return None
        out[tier] = live.rows()
    return out


def _existing_bytes(directory: str, tier: str, rank: int, fingerprint: str) -> int:
    try:
        return os.path.getsize(os.path.join(directory, home_name(tier, rank, fingerprint),
                                            "slab"))
    except OSError:
        return 0


def kept_disk_bytes(config: KvConfig, tier: str, *, world_size: int = 1,
                    block_layout: str = NATIVE_BLOCK_LAYOUT) -> int:
    """Bytes the durable slabs of ``tier`` already take for every rank of ``world_size`` in
    the configured directory: a restart reuses them, so they count as free for it."""
    directory = config.disk_dir or config.tiers[tier].path
    if not directory:
        return 0
    return sum(_existing_bytes(directory, tier, rank,
                               compatibility_of(config, rank=rank, world_size=world_size,
                                                block_layout=block_layout).fingerprint)
               for rank in range(world_size))


def object_namespace(config: KvConfig, fingerprint: str) -> str:
    """The key prefix of a shared object tier: ``kvstrata/<fingerprint>/<tenant>/``, ``_``
    for the default tenant (no tenant can be named ``_``: tenants start with a letter or a
    digit)."""
    return f"kvstrata/{fingerprint}/{config.tenant or '_'}/"


def object_store_of(config: KvConfig, tier: str, options: StorageOptions) -> S3Config:
    """Where ``tier`` (an object tier) lives: ``options.object_store`` or the tier's url."""
    if options.object_store is not None:
        return options.object_store
    url = config.tiers[tier].url
    if url is None:
        raise ManagerConfigError(f"tier {tier} (object store) needs a url "
                                 f"(tiers.{tier}.url = \"http://host:port/bucket\")")
    endpoint, _, bucket = url.rstrip("/").rpartition("/")
    try:
        return S3Config(endpoint_url=endpoint, bucket=bucket)
    except PhysicalError as exc:
        raise ManagerConfigError(f"tier {tier}: {exc}") from exc


def open_object_storage(config: KvConfig, tier: str, options: StorageOptions, *,
                        rank: int | None = None,
                        geometry: LayoutConfig | None = None) -> ObjectStorage:
    """The :class:`ObjectStorage` of object tier ``tier`` for ``rank`` (default
    ``options.rank``): its store, and the namespace of this model, geometry, rank and tenant.
    ``geometry`` is the blocks' physical geometry (default: the config's model).
    A store that does not answer is a warning (its copies fail until it does); one that
    refuses (bad credentials, no such bucket it may create) is a ``ManagerConfigError``."""
    rank = options.rank if rank is None else rank
    compat = compatibility_of(config, rank=rank, world_size=options.world_size,
                              block_layout=options.block_layout)
    store = object_store_of(config, tier, options)
    geometry = geometry or layout_config_for(config, 1)
    try:
        storage = ObjectStorage(geometry.with_blocks(config.tier_blocks(tier)), store,
                                namespace=object_namespace(config, compat.fingerprint),
                                fingerprint=compat.fingerprint, ensure_bucket=False)
    except PhysicalError as exc:
        raise ManagerConfigError(f"{tier} at {store.endpoint_url}/{store.bucket}: {exc}") from exc
    try:
        storage.client.ensure_bucket()
    except ObjectStoreTransientError as exc:
        # A cache tier that is down must not stop the engine: its copies fail (the blocks
        # stay where they are) until it answers again.
        log.warning("kvstrata: %s at %s/%s does not answer (%s); its copies fail until it "
                    "does", tier, store.endpoint_url, store.bucket, exc)
    except PhysicalError as exc:
        storage.close()
        raise ManagerConfigError(f"{tier} at {store.endpoint_url}/{store.bucket}: {exc}") from exc
    return storage


def _object(built: Storages, tier: str, geometry: LayoutConfig, options: StorageOptions
            ) -> Storage:
    return open_object_storage(built.config, tier, options, geometry=geometry)


def _fits_in_ram(tier: str, need: int) -> None:
    ram = physical_memory()
    if ram and need > ram:
        raise ManagerConfigError(f"tier {tier} needs {need} bytes of RAM ({need / 2**30:.2f} "
                                 f"GiB); this machine has {ram / 2**30:.2f} GiB")


_BUILDERS = {TierKind.DEVICE: _device, TierKind.HOST: _host, TierKind.DISK: _disk,
             TierKind.OBJECT: _object}
"""A storage builder per tier kind the manager has a backend for."""

MANAGED_KINDS: frozenset[TierKind] = frozenset(_BUILDERS)
"""The tier kinds ``KvBlockManager`` can hold bytes in."""


def _check_kv_caches(got: LayoutConfig, config: KvConfig) -> None:
    """The engine's KV tensors must have the geometry ``config.model`` describes."""
    m = config.model
    want = layout_config_for(config, got.num_blocks)
    problems = []
    if got.page_size != config.block_size:
        problems.append(f"they hold {got.page_size}-token blocks but config.block_size is "
                        f"{config.block_size}")
    if got.num_layers != want.num_layers:
        problems.append(f"{got.num_layers} layers, config.model.num_layers is "
                        f"{want.num_layers}")
    if got.outer_dim != want.outer_dim:
        problems.append(f"outer dim {got.outer_dim}, config.model.outer_dim is "
                        f"{want.outer_dim}")
    if got.inner_dim != want.inner_dim:
        problems.append(f"{got.inner_dim} elements per token (heads x head dim), "
                        f"config.model has kv_heads x head_dim = {m.kv_heads} x "
                        f"{m.head_dim} = {want.inner_dim}")
    if got.dtype != want.dtype:
        problems.append(f"dtype {got.dtype}, config.model.dtype is {want.dtype}")
    if problems:
        raise ManagerConfigError("KV tensors do not match the config: " + "; ".join(problems))
