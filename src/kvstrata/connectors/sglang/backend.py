"""kvstrata as SGLang HiCache's storage tier (L3): a ``HiCacheStorage`` backend.

SGLang's hierarchical cache keeps KV pages in GPU memory (L1) and a host pool (L2), and backs
host pages up to a storage backend (L3), which it asks for a returning prefix before
computing it. SGLang loads this class by name (``--hicache-storage-backend dynamic`` with
``{"backend_name": "kvstrata", "module_path": "kvstrata.connectors.sglang",
"class_name": "KvStrataStorage", "interface_v1": 1, ...}``); docs/sglang.md shows the flags.

How the verbs map onto kvstrata (an :class:`~kvstrata.manager.EngineOwnedManager` whose G1
is SGLang's host pool, wrapped without a copy by :mod:`.host_pool`):

* ``batch_exists(keys)`` -- how long a prefix of the pages the tiers hold;
* ``batch_set_v1(keys, host_indices)`` -- the pages at those host slots are copied down the
  tiers (G3, G4; verified on every later read); returns once nothing reads those host pages;
* ``batch_get_v1(keys, host_indices)`` -- the longest held prefix is copied into those host
  slots, verified; a page that fails its check is dropped and reported missing, so SGLang
  computes it (never reads wrong bytes).

**Keys.** SGLang names a page by the hex SHA-256 of the previous page's digest and the page's
tokens (seeded by the request's cache salt): a chain, like kvstrata's. A page's kvstrata hash
is the key's first 64 bits (:func:`page_hash`); its parent is the key before it in the batch,
or the last of ``extra_info.prefix_keys`` when SGLang passes them
(``hicache_storage_pass_prefix_keys``), else none. The backend never sees the tokens, so these
hashes are SGLang's chain, not the xxh3 chain vLLM's and Dynamo's routers compute.

**Ranks.** Each tensor-parallel rank stores its own heads (its own G3 home in one
``disk_dir``). An MLA model's KV is the same on every rank, and SGLang backs it up from one
rank only (``is_storage_writer``) and has every rank load it: kvstrata stores it once. The
writer rank runs kvstrata's tiers as above, under the identity of rank 0 of 1 (MLA pages do
not depend on the number of ranks); every other rank reads the writer's durable G3 in place
(:class:`~kvstrata.manager.follower.FollowerReader`), so MLA over several ranks needs
``disk_dir``. Only that G3 is read by the other ranks: a page the writer holds only in a G2
of kvstrata's own or in a G4 is a miss for them, and SGLang loads the shortest hit of all
ranks. Decode-context-parallel MLA (``dcp_size > 1``, one writer per shard) is refused.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Any, List, Optional, Sequence

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ...manager import ManagerConfigError, ManagerError
from ..engine_config import engine_directory, engine_sink_problems
from ...manager.engine_owned import EngineOwnedManager
from ...manager.follower import FollowerReader
from ...physical.errors import PhysicalError
from ...tiers import TOP_TIER, TierKind, first_of_kind
from ...types import BlockRecord
from .host_pool import HostPoolError, wrap_host_pool
from .settings import SGLangConfigError, kv_config, settings_from

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

__all__ = ["KvStrataStorage", "page_hash"]

log = logging.getLogger(__name__)


def page_hash(key: str) -> int:
    """kvstrata's 64-bit hash of an SGLang page key: the first 16 hex digits of its SHA-256
    (a key that is not exactly 64 lowercase hex digits: the xxh3-64 of the whole key)."""
    if isinstance(key, str) and _SHA256_HEX.fullmatch(key):
        return int(key[:16], 16)
    return xxhash.xxh3_64_intdigest(str(key).encode("utf-8", "surrogatepass"))


class KvStrataStorage(HiCacheStorage):
    """See the module docstring. SGLang's factory calls ``KvStrataStorage(storage_config,
    kwargs)``, then ``register_mem_pool_host(host_pool)``; kvstrata's tiers are built then."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = settings_from(getattr(storage_config, "extra_config", None))
        self.is_mla = bool(storage_config.is_mla_model)
        if self.is_mla and getattr(storage_config, "dcp_size", 1) > 1:
            raise SGLangConfigError(
                f"kvstrata HiCache backend: MLA with decode context parallelism (dcp_size "
                f"{storage_config.dcp_size}) is not held yet: run it without")
        self.shared = self.is_mla and storage_config.tp_size > 1
        """Every rank holds the same pages (MLA over several ranks): one rank stores them."""
        self.writer = not self.shared or storage_config.tp_rank == 0
        """Whether this rank stores pages (see the module docstring, "Ranks")."""
        self.manager: EngineOwnedManager | None = None
        self.reader: FollowerReader | None = None
        """On a rank that does not store (shared pages): the writer's G3, read in place."""
        self._publishers: list = []
        self._page_size = 0
        self._closed = False

    # -- set-up ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            pool = wrap_host_pool(mem_pool_host, self.is_mla)
        except HostPoolError as exc:
            raise SGLangConfigError(f"kvstrata HiCache backend: {exc}") from None
        config = kv_config(self.settings, pool, self._identity())
        dp_rank = int(getattr(self.storage_config, "dp_rank", 0) or 0)
        disk = first_of_kind(TierKind.DISK)
        directory = config.directory_of(disk) if disk in config.tiers else None
        if directory and dp_rank:
            # data-parallel attention ranks each have a backend of tp rank 0: one home each
            # (wherever the directory was named: disk_dir or the tier's own path)
            config = replace(config, disk_dir=engine_directory(directory, dp_rank))
        if self.shared and (disk not in config.tiers or config.directory_of(disk) is None):
            raise SGLangConfigError(
                f"kvstrata HiCache backend: an MLA model over {self.storage_config.tp_size} "
                f"ranks is stored once, in rank 0's {disk}, which the other ranks read in "
                f"place: give {disk} a directory (\"disk_dir\")")
        self.close()
        self._closed = False
        # shared pages are stored as rank 0 of 1 by their one writer
        rank, world_size = ((0, 1) if self.shared else
                            (self.storage_config.tp_rank, self.storage_config.tp_size))
        try:
            if not self.writer:
                self.reader = FollowerReader(config, kv_caches=pool.runs,
                                             kv_layout="block_page", writer_rank=rank,
                                             world_size=world_size)
            else:
                from ...events.spec import make_publisher

                problems = engine_sink_problems(self.settings.events, dp_rank)
                if problems:
                    raise SGLangConfigError("kvstrata HiCache backend: " + "; ".join(problems))
                self._publishers = [make_publisher(s, worker_id=self.settings.worker_id,
                                                   dp_rank=dp_rank)
                                    for s in self.settings.events]
                self.manager = EngineOwnedManager(
                    config, kv_caches=pool.runs, kv_layout="block_page", rank=rank,
                    world_size=world_size, observers=self._publishers)
        except (ManagerConfigError, PhysicalError) as exc:
            self.close()
            raise SGLangConfigError(f"kvstrata HiCache backend: {exc}") from None
        except BaseException:
            self.close()
            raise
        self._page_size = pool.page_size
        log.info("kvstrata: HiCache storage for %s (rank %d of %d): %d host pages of %d "
                 "tokens over %s%s", self.storage_config.model_name,
                 self.storage_config.tp_rank, self.storage_config.tp_size, pool.pages,
                 pool.page_size, ", ".join(t for t in config.tiers if t != TOP_TIER),
                 "" if self.writer else " (read from rank 0's; stored there only)")

    def _identity(self) -> str:
        """The model as stored blocks name it: SGLang's model name, and the pipeline stage and
        context-parallel rank when there are several (each holds other layers or tokens)."""
        c = self.storage_config
        name = c.model_name or ""
        if c.pp_size > 1:
            name += f"|pp{c.pp_rank}of{c.pp_size}"
        if c.attn_cp_size > 1:
            name += f"|cp{c.attn_cp_rank}of{c.attn_cp_size}"
        return name

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang registers each pool of a hybrid model (Mamba state, sliding-window KV, an
        indexer) here: kvstrata holds the KV pool alone, so any other is refused at start
        (serving KV without the state it goes with would never be a usable hit)."""
        name = getattr(host_pool_name, "value", host_pool_name)
        if name != "kv":
            self.close()       # SGLang does not undo the attach: let go of G3 and threads
            raise SGLangConfigError(f"kvstrata HiCache backend: a {name!r} host pool (beside "
                                    f"the KV pool) is not held yet; kvstrata holds plain KV "
                                    f"pools")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    # -- the verbs SGLang calls ------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        manager = self._manager("batch_exists")
        if not keys or manager is None:
            return 0
        try:
            if self.reader is not None:
                return self.reader.held([page_hash(k) for k in keys])
            return manager.held([page_hash(k) for k in keys]).result()
        except (ManagerError, PhysicalError) as exc:
            log.warning("kvstrata: batch_exists answered 0: %s", exc)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        manager = self._manager("batch_set_v1")
        if not keys or manager is None:
            return [False] * len(keys)
        if self.reader is not None:       # stored by the writer rank: say what it holds
            held = self.batch_exists(keys)
            return [i < held for i in range(len(keys))]
        try:
            records = self._records(keys, extra_info)
            manager.store(records, self._pages(host_indices, len(keys))).result()
            held = manager.held([r.sequence_hash for r in records]).result()
        except (ManagerError, ValueError) as exc:
            log.warning("kvstrata: %d page(s) not stored: %s", len(keys), exc)
            return [False] * len(keys)
        return [i < held for i in range(len(keys))]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        manager = self._manager("batch_get_v1")
        if not keys or manager is None:
            return [False] * len(keys)
        try:
            hashes, pages = [page_hash(k) for k in keys], self._pages(host_indices, len(keys))
            if self.reader is not None:
                result = self.reader.load(hashes, pages)
            else:
                result = manager.load(hashes, pages).result()
        except (ManagerError, PhysicalError, ValueError) as exc:
            log.warning("kvstrata: %d page(s) not loaded: %s", len(keys), exc)
            return [False] * len(keys)
        if result.failures:
            log.warning("kvstrata: %d page(s) failed their check and were dropped: %s",
                        len(result.failures), ", ".join(sorted({f.kind for f in result.failures})))
        return [i < len(result) for i in range(len(keys))]

    # the copying path (no interface_v1): refused at start by settings_from
    def get(self, key, target_location=None, target_sizes=None):
        raise NotImplementedError("kvstrata serves HiCache through interface_v1")

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        raise NotImplementedError("kvstrata serves HiCache through interface_v1")

    def set(self, key, value=None, target_location=None, target_sizes=None):
        raise NotImplementedError("kvstrata serves HiCache through interface_v1")

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        raise NotImplementedError("kvstrata serves HiCache through interface_v1")

    def clear(self) -> None:
        """Drop every idle block of kvstrata's tiers (SGLang's ``/clear_hicache_storage``;
        shared pages are dropped by their writer rank, and the others see them go)."""
        if self.manager is not None:
            self.manager.clear().result()

    def close(self) -> None:
        """Stop kvstrata: its copies finish, a durable G3 is kept, event sinks flushed. Later
        calls are answered as misses."""
        self._closed = True
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        publishers, self._publishers = self._publishers, []
        for publisher in publishers:
            publisher.close()

    def get_stats(self):
        return None

    # -- helpers ---------------------------------------------------------------------------
    def _manager(self, verb: str) -> EngineOwnedManager | FollowerReader | None:
        """The manager, or on a rank that does not store, the reader; None once closed (the
        verb answers a miss)."""
        held = self.manager if self.manager is not None else self.reader
        if held is None and not self._closed:
            raise RuntimeError(f"{verb} before register_mem_pool_host: SGLang registers its "
                               f"host pool first")
        return held

    def _records(self, keys: Sequence[str], extra_info) -> list[BlockRecord]:
        """Block records of the pages ``keys`` name, chained (see the module docstring)."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        parent: Optional[int] = page_hash(prefix[-1]) if prefix else None
        records = []
        for key in keys:
            h = page_hash(key)
            records.append(BlockRecord(h, h, parent, self._page_size))
            parent = h
        return records

    def _pages(self, host_indices: torch.Tensor, count: int) -> list[int]:
        """The host pool page of each of ``count`` pages: its first token slot over the page
        size (slots of a page are consecutive and page-aligned in SGLang's host pool)."""
        page = self._page_size
        slots = host_indices.reshape(-1).to("cpu", torch.int64)
        if slots.numel() != count * page:
            raise ValueError(f"{count} pages need {count * page} host slots, got "
                             f"{slots.numel()}")
        rows = slots.view(count, page)
        firsts = rows[:, 0]
        if bool((firsts % page != 0).any()) or not torch.equal(
                rows, firsts[:, None] + torch.arange(page, dtype=torch.int64)):
            raise ValueError("host slots of a page are not one whole page")
        return (firsts // page).tolist()
