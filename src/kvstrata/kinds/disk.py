"""A slab file on local disk (G3).

In a directory the config names (:meth:`~kvstrata.config.KvConfig.directory_of`) it is
*durable* (:meth:`~kvstrata.physical.DiskStorage.durable`): it lives in a home named by the
compatibility fingerprint of the blocks (:mod:`kvstrata.compat`) and the rank, locked for its
process, and what a previous process stored there is recovered and verified when first read.
With the deployment's secret set (:mod:`kvstrata.secret`) its blocks are tagged with a key
derived from it (:mod:`kvstrata.physical.tags`), and only blocks tagged under that key are
read back; without one its protection is the home's ownership and mode.
Without a directory (or with ``durable_disk=False``) it is a temporary slab removed on close,
in a directory of its own that a killed process's successor reclaims. Its blocks move through
host RAM. It must fit the free space of its filesystem, counting the slabs a restart reuses.
"""

from __future__ import annotations

import os
import tempfile

from ..config import KvConfig, format_size
from ..physical import DiskStorage, LayoutConfig, PhysicalError, Storage
from ..paths import directory_problem
from ..physical.capacity import free_disk_bytes
from ..physical.leftovers import owner_tag, reclaim
from ..physical.storage.disk import slab_stride
from ..physical.storage.disk_home import home_name
from ..physical.storage.disk_index import DiskIndex
from ..physical.tags import keys_at_rest
from ..placement.costs import CostPrior
from ..secret import SECRET_ENV, SECRET_FILE_ENV, SecretError
from ..tiers import TierKind
from .base import Kind, RecoveredRow, StorageOptions, TierSetupError, layout_config_for

__all__ = ["DiskKind", "KIND"]


class DiskKind(Kind):
    """A local disk: a few GB/s and a millisecond per plan until measured."""

    kind = TierKind.DISK
    cost_prior = CostPrior(bandwidth=1.5e9, overhead=1e-3)
    through_host = True

    def problems(self, config: KvConfig, tier: str, options: StorageOptions,
                 ranks: int = 1) -> list[str]:
        path = config.tiers[tier].path
        if path is not None and not isinstance(path, (str, os.PathLike)):
            return [f"tier {tier}: path must be a string, got {path!r}"]
        directory = config.directory_of(tier)
        problem = directory_problem(directory) if directory is not None else None
        if problem:
            return [f"tier {tier}: directory {directory} {problem}"]
        try:
            keys = keys_at_rest(options.secret)
        except SecretError as exc:
            return [f"tier {tier}: {exc}"]
        if config.encrypt_at_rest and keys is None:
            return [f"tier {tier}: encrypt_at_rest needs the deployment's secret "
                    f"(${SECRET_ENV}, or a private file named by ${SECRET_FILE_ENV})"]
        need = ranks * config.tier_blocks(tier) * slab_stride(layout_config_for(config, 1))
        if directory is not None and options.durable_disk:
            need -= sum(self._kept_bytes(config, tier, directory, options, rank)
                        for rank in range(options.rank, options.rank + ranks))
        where = directory or tempfile.gettempdir()
        free = free_disk_bytes(where)
        if free is not None and need > free:
            held_by = f" ({ranks} ranks)" if ranks > 1 else ""
            return [f"tier {tier}{held_by} needs {need} bytes of disk ({format_size(need)}); "
                    f"{where} has {format_size(free)} free"]
        return []

    def build(self, tier: str, built, geometry: LayoutConfig | None,
              options: StorageOptions) -> Storage:
        config = built.config
        if options.follow_durable:          # another process writes it: nothing made here
            return self.open_followed(config, tier, geometry, options)
        directory = config.directory_of(tier)
        if directory is None:
            prefix = f"kvstrata-{tier.lower()}-"
            reclaim(tempfile.gettempdir(), prefix)            # left by killed processes
            directory = tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-")
            built.temp_dirs.append(directory)
            durable = False
        else:
            durable = options.durable_disk
        layout = geometry.with_blocks(config.tier_blocks(tier))
        try:
            keys = keys_at_rest(options.secret)
        except SecretError as exc:
            raise TierSetupError(f"{tier}: {exc}") from None
        protection = dict(tagger=keys and keys.tagger, cipher=keys and keys.cipher,
                          encrypt=config.encrypt_at_rest)
        try:
            if durable:
                compat = options.compatibility(config)
                return DiskStorage.durable(layout, directory, fingerprint=compat.fingerprint,
                                           rank=options.rank, describe=compat.describe(),
                                           sync=options.disk_sync, name=tier.lower(),
                                           o_direct=options.o_direct, file_ops=options.file_ops,
                                           **protection)
            return DiskStorage(layout, directory, o_direct=options.o_direct,
                               file_ops=options.file_ops, **protection)
        except PhysicalError as exc:
            raise TierSetupError(f"{tier} in {directory}: {exc}") from exc

    def open_followed(self, config: KvConfig, tier: str, geometry: LayoutConfig,
                      options: StorageOptions) -> DiskStorage:
        """The durable ``tier`` that another process with these ``options`` (its rank, its
        fingerprint) keeps in the config's directory, opened read-only to follow it
        (:meth:`~kvstrata.physical.DiskStorage.follow`); ``geometry`` is the fastest tier's.
        Raises :class:`TierSetupError` when the tier is not durable here, or when there is
        no such tier yet or it cannot be trusted."""
        directory = config.directory_of(tier)
        if directory is None or not options.durable_disk:
            raise TierSetupError(f"{tier} is followed only where it is durable: give it a "
                                 f"directory")
        try:
            keys = keys_at_rest(options.secret)
        except SecretError as exc:
            raise TierSetupError(f"{tier}: {exc}") from None
        try:
            return DiskStorage.follow(geometry.with_blocks(config.tier_blocks(tier)), directory,
                                      fingerprint=options.compatibility(config).fingerprint,
                                      rank=options.rank, name=tier.lower(),
                                      o_direct=options.o_direct, file_ops=options.file_ops,
                                      tagger=keys and keys.tagger, cipher=keys and keys.cipher)
        except PhysicalError as exc:
            raise TierSetupError(f"{tier} in {directory}: {exc}") from exc

    def followed_exists(self, config: KvConfig, tier: str, options: StorageOptions) -> bool:
        """Whether the durable ``tier`` that :meth:`open_followed` would open has been made
        (by the process that writes it): its slab, sized, and its journal, which the writer
        makes after sizing the slab. True where ``options`` do not follow it."""
        if not options.follow_durable:
            return True
        directory = config.directory_of(tier)
        if directory is None or not options.durable_disk:
            return False
        home = self.followed_where(config, tier, options)
        return all(os.path.exists(os.path.join(home, name)) for name in ("slab", "index"))

    def followed_where(self, config: KvConfig, tier: str, options: StorageOptions) -> str:
        directory = config.directory_of(tier)
        if directory is None:
            return ""
        return os.path.join(directory, home_name(tier.lower(), options.rank,
                                                 options.compatibility(config).fingerprint))

    def recovered_rows(self, storage: Storage) -> list[RecoveredRow]:
        live = getattr(storage, "recovered", None)
        return live.rows() if live else []

    def peek_recovered(self, config: KvConfig, tier: str, options: StorageOptions,
                       rank: int) -> list[RecoveredRow] | None:
        directory = config.directory_of(tier)
        if directory is None or not options.durable_disk:
            return []                                  # a temporary slab: nothing kept
        fingerprint = options.compatibility(config, rank).fingerprint
        layout = layout_config_for(config, config.tier_blocks(tier))
        try:
            keys = keys_at_rest(options.secret)
        except SecretError:
            return None
        live = DiskIndex.peek(os.path.join(directory, home_name(tier, rank, fingerprint),
                                           "index"),
                              capacity=layout.num_blocks, fingerprint=fingerprint,
                              stride=slab_stride(layout),
                              key_id=0 if keys is None else keys.tagger.key_id)
        return None if live is None else live.rows()

    @staticmethod
    def _kept_bytes(config: KvConfig, tier: str, directory: str, options: StorageOptions,
                    rank: int) -> int:
        """Bytes the durable slab of ``rank`` already takes: a restart reuses them."""
        home = home_name(tier, rank, options.compatibility(config, rank).fingerprint)
        try:
            return os.path.getsize(os.path.join(directory, home, "slab"))
        except OSError:
            return 0


KIND = DiskKind()
