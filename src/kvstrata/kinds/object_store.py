"""An S3-compatible object store shared by workers (G4), addressed by keys.

The store is named by the tier's ``url`` (``http://host:port/bucket``) or
``StorageOptions.object_store``; its blocks live under the namespace
``kvstrata/<fingerprint>/<tenant>/``, so incompatible models and other tenants never read
each other's blocks. Every worker of the same model, geometry, rank and tenant on that bucket
sees the blocks the others put. Its blocks move through host RAM. A store that does not
answer at start is a warning (its copies fail until it does); one that refuses is an error.

Everyone with the bucket's credentials can write it, so a G4 tier needs the deployment's
secret (:mod:`kvstrata.secret`): every object carries a tag keyed from it
(:mod:`kvstrata.physical.tags`) and an object without that tag is never read as a block.
Without a secret the tier is refused at start.
"""

from __future__ import annotations

import logging

from ..config import KvConfig
from ..physical import LayoutConfig, PhysicalError, Storage
from ..physical.storage.objects import ObjectStorage
from ..physical.storage.s3client import ObjectStoreTransientError, S3Config
from ..physical.tags import KeysAtRest, keys_at_rest
from ..placement.costs import CostPrior
from ..secret import SECRET_ENV, SECRET_FILE_ENV, SecretError
from ..tiers import TierKind
from .base import Kind, StorageOptions, TierSetupError, layout_config_for

__all__ = ["ObjectStoreKind", "KIND", "object_namespace"]

log = logging.getLogger(__name__)


class ObjectStoreKind(Kind):
    """A remote store: 100 MB/s and 20 ms per plan until measured (conservative)."""

    kind = TierKind.OBJECT
    cost_prior = CostPrior(bandwidth=100e6, overhead=20e-3)
    through_host = True

    def problems(self, config: KvConfig, tier: str, options: StorageOptions,
                 ranks: int = 1) -> list[str]:
        if options.object_store is None and not config.tiers[tier].url:
            return [f"tier {tier} (object store) needs a url: "
                    f'tiers.{tier}.url = "http://host:port/bucket"']
        try:
            _keys(tier, options)
        except TierSetupError as exc:
            return [str(exc)]
        return []

    def build(self, tier: str, built, geometry: LayoutConfig | None,
              options: StorageOptions) -> Storage:
        return self.open(built.config, tier, options, geometry=geometry)

    def open_shared(self, config: KvConfig, tier: str, options: StorageOptions,
                    rank: int) -> ObjectStorage:
        return self.open(config, tier, options, rank=rank)

    def open(self, config: KvConfig, tier: str, options: StorageOptions, *,
             rank: int | None = None, geometry: LayoutConfig | None = None) -> ObjectStorage:
        """The :class:`ObjectStorage` of ``tier`` for ``rank`` (default ``options.rank``):
        its store, and the namespace of this model, geometry, rank and tenant. ``geometry``
        is the blocks' physical geometry (default: the config's model)."""
        compat = options.compatibility(config, rank)
        store = _store_of(config, tier, options)
        geometry = geometry or layout_config_for(config, 1)
        keys = _keys(tier, options)
        try:
            storage = ObjectStorage(geometry.with_blocks(config.tier_blocks(tier)), store,
                                    namespace=object_namespace(config, compat.fingerprint,
                                                               keys.tagger.key_id),
                                    fingerprint=compat.fingerprint, ensure_bucket=False,
                                    tagger=keys.tagger, cipher=keys.cipher,
                                    encrypt=config.encrypt_at_rest)
        except PhysicalError as exc:
            raise TierSetupError(f"{tier} at {store.endpoint_url}/{store.bucket}: {exc}") from exc
        try:
            storage.client.ensure_bucket()
        except ObjectStoreTransientError as exc:
            # A cache tier that is down must not stop the engine: its copies fail (the
            # blocks stay where they are) until it answers again.
            log.warning("kvstrata: %s at %s/%s does not answer (%s); its copies fail until "
                        "it does", tier, store.endpoint_url, store.bucket, exc)
        except PhysicalError as exc:
            storage.close()
            raise TierSetupError(f"{tier} at {store.endpoint_url}/{store.bucket}: {exc}") from exc
        return storage


def object_namespace(config: KvConfig, fingerprint: str, key_id: int) -> str:
    """The key prefix of a shared object tier:
    ``kvstrata/<fingerprint>/k<key id>[e]/<tenant>/``, ``e`` when ``encrypt_at_rest``, ``_``
    for the default tenant (no tenant can be named ``_``: tenants start with a letter or a
    digit). The key id (:attr:`~kvstrata.physical.tags.BlockTagger.key_id`) and the mode keep
    the objects of each deployment secret, and of encryption on or off, apart: after a change
    of either (or from an older, unkeyed release) the old objects are simply elsewhere (to
    delete), never blocks that fail at keys the new ones cannot be stored under, nor
    plaintext served once encryption is on."""
    mode = "e" if config.encrypt_at_rest else ""
    return f"kvstrata/{fingerprint}/k{key_id:016x}{mode}/{config.tenant or '_'}/"


def _keys(tier: str, options: StorageOptions) -> KeysAtRest:
    """The keys of the deployment's secret; :class:`TierSetupError` without one."""
    try:
        keys = keys_at_rest(options.secret)
    except SecretError as exc:
        raise TierSetupError(f"tier {tier} (object store): {exc}") from None
    if keys is None:
        raise TierSetupError(
            f"tier {tier} (object store) needs the deployment's secret (${SECRET_ENV}, or a "
            f"private file named by ${SECRET_FILE_ENV}), the same in every worker: whoever "
            f"can write the bucket could otherwise put blocks that pass as this "
            f"deployment's")
    return keys


def _store_of(config: KvConfig, tier: str, options: StorageOptions) -> S3Config:
    """Where ``tier`` lives: ``options.object_store`` or the tier's url."""
    if options.object_store is not None:
        return options.object_store
    url = config.tiers[tier].url
    if url is None:
        raise TierSetupError(f"tier {tier} (object store) needs a url "
                             f'(tiers.{tier}.url = "http://host:port/bucket")')
    endpoint, _, bucket = url.rstrip("/").rpartition("/")
    try:
        return S3Config(endpoint_url=endpoint, bucket=bucket)
    except PhysicalError as exc:
        raise TierSetupError(f"tier {tier}: {exc}") from exc


KIND = ObjectStoreKind()
