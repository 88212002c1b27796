"""``KvBlockManager``: the one-process facade over pools, storages and transfers.

Built from a :class:`~kvstrata.config.KvConfig` (tiers, policies, model geometry): one pool per
tier (:class:`~kvstrata.logical.hierarchy.TierHierarchy`), a storage per tier (G1 device
memory, allocated -- a CPU tensor standing in without a GPU -- or wrapping the engine's KV
tensors; G2 host RAM; G3 a slab file), a :class:`~kvstrata.physical.TransferEngine`, and a
:class:`~kvstrata.offload.TransferCoordinator` that moves blocks between them.

**Threading.** One *owner thread* mutates the pools (DESIGN.md "one owner per pool"). Public
methods post a command to its queue and return a ``concurrent.futures.Future``; transfer
workers post completions to the same queue, so the owner sleeps on one queue and never polls.
No lock is held across I/O. Callbacks attached to the returned futures may run on the owner
thread: they must not block on another future of the same manager.

**Handles.** Handles handed out (``allocate``, ``register``, ``match``, ``onboard``) belong to
the G1 pool; give them back with :meth:`KvBlockManager.release` (or
:meth:`~kvstrata.offload.OnboardResult.release`), which runs on the owner thread. Do not call
``handle.release()`` from your own thread; a dropped handle is returned safely by its
finalizer.

Typical use::

    with KvBlockManager(config) as mgr:
        blocks = mgr.allocate(2).result()
        mgr.write_g1(blocks.block_ids, payloads)      # the engine "computes" KV
        blocks.apply_token_blocks(records)
        mgr.release(mgr.register(blocks).result())    # offloaded to G2 (and G3) in background
        mgr.flush().result()
        with mgr.onboard([r.sequence_hash for r in records]).result() as loaded:
            ...                                       # loaded.block_ids hold verified bytes
"""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import asdict, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .config import KvConfig
from .logical.handles import ImmutableBlocks, MutableBlocks, _Blocks
from .logical.hierarchy import TierHierarchy
from .logical.registry import BlockRegistry, RegistryObserver
from .metrics import ManagerMetrics
from .offload import TIER_ORDER, Completion, OnboardResult, TransferCoordinator
from .physical import (DeviceStorage, DiskStorage, FileOps, HostStorage, LayoutConfig,
                       PhysicalError, Storage, TransferEngine)

__all__ = ["KvBlockManager", "OnboardResult", "ManagerError", "ManagerClosedError",
           "ManagerConfigError", "layout_config_for"]

log = logging.getLogger(__name__)

HOST_ALIGNMENT = 4096
"""G2 block stride alignment: lets the disk read/write host slots in place with O_DIRECT."""


class ManagerError(RuntimeError):
    """Base class of block manager errors."""


class ManagerClosedError(ManagerError):
    """The manager was closed; it accepts no more calls."""


class ManagerConfigError(ManagerError, ValueError):
    """The configuration cannot be turned into tiers (unsupported tier, size over a limit,
    KV tensors that do not match the config)."""


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


class _Command:
    """A call to run on the owner thread. ``deferred`` calls resolve the future themselves."""

    __slots__ = ("fn", "future", "deferred")

    def __init__(self, fn: Callable, deferred: bool = False) -> None:
        self.fn = fn
        self.future: Future = Future()
        self.deferred = deferred

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            if self.deferred:
                self.fn(self.future)
            else:
                self.future.set_result(self.fn())
        except BaseException as exc:  # handed to the caller, never kills the owner
            if not self.future.done():
                self.future.set_exception(exc)


_STOP = object()


class KvBlockManager:
    """Tiered KV block manager for one process. See the module docstring.

    Parameters (all keyword-only except ``config``):

    * ``kv_caches`` -- the engine's per-layer KV tensors to wrap as G1 (zero-copy); their
      block count becomes G1's size, their page size must equal ``config.block_size``.
      Without it G1 is allocated (``g1_layout``: ``outer_contiguous``, ``block_contiguous``
      or ``fully_contiguous``) on ``device`` (CUDA if available, else CPU stand-in).
    * ``disk_dir`` -- directory of the G3 slab file; default ``config.disk_dir``, then
      ``tiers["G3"].path``, else a temporary directory removed on :meth:`close`.
    * ``verify_host_reads`` -- re-hash G2 bytes on every read from G2 (G3 reads always verify).
    * ``max_host_bytes`` -- refuse (``ManagerConfigError``) a G2 bigger than this.
    * ``o_direct`` / ``file_ops`` -- passed to :class:`~kvstrata.physical.DiskStorage`
      (``file_ops`` is the fault-injection seam).
    * ``metrics_registry`` -- a ``CollectorRegistry`` (default: a private one);
      ``metrics_port`` -- serve ``/metrics`` on 127.0.0.1:port (0 = any free port; off by
      default), the bound port is :attr:`metrics_port`.
    * ``workers_per_path`` -- transfer worker threads per path.
    """

    def __init__(self, config: KvConfig | None = None, *,
                 kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | None = None,
                 kv_layout: str = "auto", g1_layout: str = "outer_contiguous",
                 device: str | torch.device | None = None, disk_dir: str | None = None,
                 verify_host_reads: bool = False, max_host_bytes: int | None = None,
                 o_direct: bool | None = None, file_ops: FileOps | None = None,
                 metrics_registry=None, metrics_port: int | None = None,
                 workers_per_path: int = 1) -> None:
        config = (config or KvConfig()).validate()
        unsupported = [t for t in config.tiers if t not in TIER_ORDER]
        if unsupported:
            raise ManagerConfigError(f"tiers {unsupported} are not supported by KvBlockManager "
                                     f"(it manages {', '.join(TIER_ORDER)})")
        if "G3" in config.tiers and "G2" not in config.tiers:
            raise ManagerConfigError("tier G3 needs tier G2 (disk blocks move through host RAM)")
        self._storages: dict[str, Storage] = {}
        self._temp_dir: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._idle_waiters: list[Future] = []
        self.metrics = ManagerMetrics(metrics_registry)
        self.metrics_port: int | None = None
        try:
            g1 = self._build_g1(config, kv_caches, kv_layout, g1_layout, device)
            if g1.num_blocks != config.tier_blocks("G1"):
                tiers = dict(config.tiers)
                tiers["G1"] = replace(tiers["G1"], blocks=g1.num_blocks, bytes=None)
                config = replace(config, tiers=tiers)
            self.config = config
            self._build_lower_tiers(config, g1.config, disk_dir, verify_host_reads,
                                    max_host_bytes, o_direct, file_ops)
            self.hierarchy = TierHierarchy(config)
            self.engine = TransferEngine(self._storages, workers_per_path=workers_per_path)
        except BaseException:
            self._close_storages()
            raise
        self.pools = self.hierarchy.pools
        self.coordinator = TransferCoordinator(self.pools, self.hierarchy.admission, self.engine,
                                               self._queue.put, self.metrics, self.release)
        for tier, storage in self._storages.items():
            self.metrics.set_capacity(tier, storage.num_blocks, storage.status().bytes)
        self._owner = threading.Thread(target=self._run, name="kvstrata-manager-owner",
                                       daemon=True)
        self._owner.start()
        if metrics_port is not None:
            self.metrics_port = self.metrics.serve(metrics_port)

    # ------------------------------------------------------------------ construction
    def _build_g1(self, config: KvConfig, kv_caches, kv_layout: str, g1_layout: str,
                  device) -> DeviceStorage:
        try:
            if kv_caches is not None:
                g1 = DeviceStorage.wrap(kv_caches, kv_layout=kv_layout)
                if g1.config.page_size != config.block_size:
                    raise ManagerConfigError(
                        f"KV tensors hold {g1.config.page_size}-token blocks but "
                        f"config.block_size is {config.block_size}")
            else:
                g1 = DeviceStorage.allocate(layout_config_for(config, config.tier_blocks("G1")),
                                            device=device, kv_layout=g1_layout)
        except PhysicalError as exc:
            raise ManagerConfigError(f"G1: {exc}") from exc
        self._storages["G1"] = g1
        return g1

    def _build_lower_tiers(self, config: KvConfig, geometry: LayoutConfig, disk_dir, verify,
                           max_host_bytes, o_direct, file_ops) -> None:
        if "G2" in config.tiers:
            host_cfg = geometry.with_blocks(config.tier_blocks("G2")).with_alignment(
                HOST_ALIGNMENT)
            need = host_cfg.num_blocks * -(-host_cfg.block_bytes // HOST_ALIGNMENT) \
                * HOST_ALIGNMENT
            if max_host_bytes is not None and need > max_host_bytes:
                raise ManagerConfigError(
                    f"G2 of {host_cfg.num_blocks} blocks needs {need / 2**30:.2f} GiB of host "
                    f"RAM, over the limit of {max_host_bytes / 2**30:.2f} GiB; shrink tier G2")
            self._storages["G2"] = HostStorage(host_cfg, verify_reads=verify)
        if "G3" in config.tiers:
            directory = disk_dir or config.disk_dir or config.tiers["G3"].path
            if directory is None:
                directory = self._temp_dir = tempfile.mkdtemp(prefix="kvstrata-g3-")
            try:
                self._storages["G3"] = DiskStorage(
                    geometry.with_blocks(config.tier_blocks("G3")), directory,
                    o_direct=o_direct, file_ops=file_ops)
            except PhysicalError as exc:
                raise ManagerConfigError(f"G3 in {directory}: {exc}") from exc

    # ------------------------------------------------------------------ owner thread
    def _run(self) -> None:
        get, coordinator = self._queue.get, self.coordinator
        while True:
            item = get()
            if item is _STOP:
                return
            try:
                if isinstance(item, Completion):
                    coordinator.complete(item)
                else:
                    item.run()
                self.engine.drain_completions()   # results arrive via futures; keep it empty
                if coordinator.idle and self._idle_waiters:
                    waiters, self._idle_waiters = self._idle_waiters, []
                    for waiter in waiters:
                        waiter.set_result(None)
                self._publish_pool_metrics()
            except Exception:  # a bug: keep the owner alive, say what happened
                log.exception("kvstrata manager owner thread failed handling %r", item)

    def _publish_pool_metrics(self) -> None:
        for tier, pool in self.pools.items():
            s = pool.status()
            self.metrics.set_pool(tier, s.active, s.inactive, s.reset, s.evictions)

    def _call(self, fn: Callable, deferred: bool = False, *, internal: bool = False) -> Future:
        if self._closed and not internal:
            raise ManagerClosedError("block manager is closed")
        command = _Command(fn, deferred)
        self._queue.put(command)
        return command.future

    # ------------------------------------------------------------------ G1 blocks
    def allocate(self, count: int) -> "Future[MutableBlocks]":
        """``count`` G1 blocks (Reset) for KV the engine is about to compute; evicts inactive
        G1 blocks by policy. Fails with ``PoolExhaustedError`` if too many are in use."""
        return self._call(lambda: self.pools["G1"].allocate(count))

    def register(self, blocks: MutableBlocks, priority: int = 0) -> "Future[ImmutableBlocks]":
        """Register Complete G1 blocks (their bytes are written) and start offloading the new
        ones down the tiers. ``blocks`` is consumed; the future holds handles on the
        registered blocks (a hash already held is deduplicated to the existing block)."""
        def run() -> ImmutableBlocks:
            g1 = self.pools["G1"]
            before = blocks.block_ids
            registered = g1.register(blocks, priority)
            new = [b.record() for b, slot in zip(registered.blocks, before)
                   if b.block_id == slot]
            self.coordinator.offload("G1", new)
            return registered
        return self._call(run)

    def match(self, sequence_hashes: Sequence[int]) -> "Future[ImmutableBlocks]":
        """Handles on the longest prefix of ``sequence_hashes`` already in G1."""
        hashes = list(sequence_hashes)
        return self._call(lambda: self.pools["G1"].match(hashes))

    def locate(self, sequence_hashes: Sequence[int]) -> "Future[list[str]]":
        """For the longest prefix held in any tier, the fastest tier holding each block
        (no side effect)."""
        hashes = list(sequence_hashes)
        return self._call(lambda: self.coordinator.locate(hashes))

    def onboard(self, sequence_hashes: Sequence[int]) -> "Future[OnboardResult]":
        """Bring the longest prefix of ``sequence_hashes`` held in any tier into G1.

        The future resolves when every needed copy completed, with an
        :class:`~kvstrata.offload.OnboardResult`: G1 handles on the verified prefix, the tier
        each block came from, and the blocks whose load failed (dropped from their tier).
        """
        hashes = list(sequence_hashes)

        def run(future: Future) -> None:
            # Admission filters that learn from requests see every request's hashes.
            observe = getattr(self.hierarchy, "observe_request", None)
            if observe is not None:
                observe(hashes)
            self.coordinator.start_onboard(hashes, future)
        return self._call(run, deferred=True)

    def release(self, handle: _Blocks) -> "Future[None]":
        """Give a handle of the G1 pool back (on the owner thread)."""
        if handle.pool is not self.pools["G1"]:
            raise ManagerError(f"handle of pool {handle.pool.tier} is not a G1 handle")
        if not self._owner.is_alive():   # closed: the pools are gone, nothing to give back
            done: Future = Future()
            done.set_result(None)
            return done
        return self._call(lambda: None if handle.released else handle.release(), internal=True)

    def evict(self, tier: str, sequence_hashes: Sequence[int]) -> "Future[list[int]]":
        """Drop idle blocks from ``tier`` (invalidation); returns the hashes dropped. Blocks
        in use, or (leaf-first policies) with registered children, are left alone."""
        if tier not in self.pools:
            raise ManagerError(f"no tier {tier!r}; tiers are {sorted(self.pools)}")
        hashes = list(sequence_hashes)
        return self._call(lambda: self.pools[tier].reset_blocks(hashes))

    def add_observer(self, observer: RegistryObserver) -> "Future[None]":
        """Attach a registry observer (it runs on the owner thread; keep it cheap)."""
        return self._call(lambda: self.registry.add_observer(observer))

    # ------------------------------------------------------------------ bytes of G1
    def write_g1(self, block_ids: Sequence[int], payloads: Sequence[np.ndarray]) -> None:
        """Write each payload (``block_bytes`` of uint8, layer-major: layer, K/V, tokens,
        elements) into a G1 block the caller holds as ``MutableBlocks`` -- what an engine's
        forward pass does. Runs on the caller's thread (bytes, not pool state)."""
        regions, chunk, spans = self._g1_chunks()
        for block_id, payload in zip(block_ids, payloads):
            data = np.asarray(payload).reshape(-1).view(np.uint8)
            if data.size != len(spans) * chunk:
                raise ValueError(f"payload has {data.size} bytes, a block has "
                                 f"{len(spans) * chunk}")
            for i, (region, offset_of) in enumerate(spans):
                start = offset_of(block_id)
                regions[region][start:start + chunk] = data[i * chunk:(i + 1) * chunk]

    def read_g1(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Copies of G1 blocks' payloads (same byte order as :meth:`write_g1`)."""
        regions, chunk, spans = self._g1_chunks()
        out = []
        for block_id in block_ids:
            data = np.empty(len(spans) * chunk, dtype=np.uint8)
            for i, (region, offset_of) in enumerate(spans):
                start = offset_of(block_id)
                data[i * chunk:(i + 1) * chunk] = regions[region][start:start + chunk]
            out.append(data)
        return out

    def _g1_chunks(self):
        cached = getattr(self, "_g1_chunk_cache", None)
        if cached is None:
            g1 = self._storages["G1"]
            layout, cfg = g1.layout, g1.config
            regions = [r.numpy() for r in g1.memory.regions]
            spans = []
            for layer in range(cfg.num_layers):
                for outer in range(cfg.outer_dim):
                    r0 = layout.region_of(0, layer, outer)
                    step = (layout.region_of(1, layer, outer).offset - r0.offset
                            if cfg.num_blocks > 1 else 0)
                    spans.append((r0.index, lambda b, o=r0.offset, s=step: o + b * s))
            cached = self._g1_chunk_cache = (regions, cfg.chunk_bytes, spans)
        return cached

    # ------------------------------------------------------------------ waiting, status
    def flush(self) -> "Future[None]":
        """A future resolved once no transfer is pending (offloads included)."""
        def run(future: Future) -> None:
            if self.coordinator.idle:
                future.set_result(None)
            else:
                self._idle_waiters.append(future)
        return self._call(run, deferred=True, internal=True)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until no transfer is pending (``flush().result(timeout)``)."""
        self.flush().result(timeout)

    def status(self) -> dict[str, Any]:
        """Per tier: pool counts (capacity, active, inactive, reset, evictions), storage
        status (kind, bytes, stand_in, o_direct, path, ...), quarantined blocks; plus
        ``stand_in`` (G1 is a CPU tensor), ``transfers_pending`` and ``disk_dir``."""
        def run() -> dict[str, Any]:
            tiers = {}
            for tier, pool in self.pools.items():
                tiers[tier] = {"pool": asdict(pool.status()),
                               "storage": self._storages[tier].status().to_dict(),
                               "quarantined": len(self.coordinator._quarantine[tier])}
            g1 = self._storages["G1"].status()
            return {"tiers": tiers, "stand_in": g1.stand_in,
                    "transfers_pending": self.coordinator.pending,
                    "block_bytes": g1.block_bytes,
                    "disk_dir": str(self._storages["G3"].path.parent)
                    if "G3" in self._storages else None}
        return self._call(run, internal=True).result()

    def transfer_stats(self) -> dict[str, dict[str, float]]:
        """Per path: plans, blocks, bytes, failed blocks, busy seconds, GB/s."""
        return self._call(lambda: {p: s.as_dict() for p, s in
                                   sorted(self.coordinator.stats.items())},
                          internal=True).result()

    @property
    def registry(self) -> BlockRegistry:
        return self.hierarchy.registry

    def storage(self, tier: str) -> Storage:
        """The storage of ``tier`` (tests and byte-level tools)."""
        return self._storages[tier]

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Wait for pending transfers, stop the owner thread and the transfer engine, free
        storages (the G3 slab file is deleted) and stop the metrics endpoint. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.flush().result()
        finally:
            self._queue.put(_STOP)
            self._owner.join()
            self.engine.close()
            self.metrics.close()
            self._close_storages()

    def _close_storages(self) -> None:
        for storage in self._storages.values():
            storage.close()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> "KvBlockManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
