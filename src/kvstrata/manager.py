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
import numbers
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
from .logical.block import BlockState
from .logical.handles import ImmutableBlocks, MutableBlocks, _Blocks
from .logical.hierarchy import TierHierarchy
from .logical.registry import BlockRegistry, RegistryObserver
from .metrics import ManagerMetrics
from .offload import TIER_ORDER, Completion, OnboardResult, TransferCoordinator
from .physical import (DeviceStorage, DiskStorage, FileOps, HostStorage, LayoutConfig,
                       PhysicalError, Storage, TransferEngine)

__all__ = ["KvBlockManager", "OnboardResult", "ManagerError", "ManagerClosedError",
           "ManagerConfigError", "InvalidBlockError", "layout_config_for"]

log = logging.getLogger(__name__)

HOST_ALIGNMENT = 4096
"""G2 block stride alignment: lets the disk read/write host slots in place with O_DIRECT."""


class ManagerError(RuntimeError):
    """Base class of block manager errors."""


class ManagerClosedError(ManagerError):
    """The manager was closed; it accepts no more calls."""


class ManagerConfigError(ManagerError, ValueError):
    """The configuration cannot be turned into tiers (unsupported tier, size over a limit,
    KV tensors that do not match the config, a metrics port that cannot be bound)."""


class InvalidBlockError(ManagerError, ValueError):
    """A call named blocks it may not use: a block id out of range, a block not held or
    already registered, a payload of the wrong size, a block identity (hash, block size) that
    cannot be stored. Raised before anything changed."""


_U64 = 1 << 64


def _is_u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _U64


def _resolved(value: object = None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


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
        self._closed = False          # close() started: public calls are refused
        self._close_lock = threading.Lock()
        self._close_done = threading.Event()
        # Guards _stopped/_broken together with posting to the queue, so nothing is posted
        # after the owner's stop marker (it would never run).
        self._state_lock = threading.Lock()
        self._stopped = False         # the owner thread was told to stop
        self._broken: ManagerError | None = None   # the owner thread hit a bug
        self._idle_waiters: list[Future] = []
        self.metrics = ManagerMetrics(metrics_registry)
        self.metrics_port: int | None = None
        self.engine: TransferEngine | None = None
        try:
            if metrics_port is not None:   # first: a busy port must not leak threads or dirs
                try:
                    self.metrics_port = self.metrics.serve(metrics_port)
                except OSError as exc:
                    raise ManagerConfigError(
                        f"cannot serve metrics on 127.0.0.1:{metrics_port}: {exc}") from exc
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
            self.pools = self.hierarchy.pools
            self.coordinator = TransferCoordinator(self.pools, self.hierarchy.admission,
                                                   self.engine, self._queue.put, self.metrics,
                                                   self.release)
            for tier, storage in self._storages.items():
                self.metrics.set_capacity(tier, storage.num_blocks, storage.status().bytes)
            self._owner = threading.Thread(target=self._run, name="kvstrata-manager-owner",
                                           daemon=True)
            self._owner.start()
        except BaseException:
            if self.engine is not None:
                self.engine.close()
            self.metrics.close()
            self._close_storages()
            raise

    # ------------------------------------------------------------------ construction
    def _build_g1(self, config: KvConfig, kv_caches, kv_layout: str, g1_layout: str,
                  device) -> DeviceStorage:
        try:
            if kv_caches is not None:
                g1 = DeviceStorage.wrap(kv_caches, kv_layout=kv_layout)
                _check_kv_caches(g1.config, config)
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
            if self._broken is not None:
                self._refuse(item)
                continue
            try:
                if isinstance(item, Completion):
                    coordinator.complete(item)    # settles its handles even when it fails
                else:
                    item.run()                    # errors go to the caller's future
                self.engine.drain_completions()   # results arrive via futures; keep it empty
                if coordinator.idle and self._idle_waiters:
                    waiters, self._idle_waiters = self._idle_waiters, []
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_result(None)
                self._publish_pool_metrics()
            except Exception as exc:   # a bug outside any one request: the state is suspect
                log.exception("kvstrata manager owner thread failed handling %r", item)
                self._break(exc)

    def _break(self, cause: Exception) -> None:
        """Mark the manager broken and fail everything still waiting (owner thread)."""
        error = ManagerError(f"kvstrata manager failed on its owner thread ({cause!r}); it "
                             f"accepts no more calls, close it")
        error.__cause__ = cause
        with self._state_lock:
            self._broken = error
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)
        try:
            self.coordinator.fail_all(error)
        except Exception:
            log.exception("kvstrata manager: failing outstanding onboards failed")

    def _refuse(self, item: object) -> None:
        """A broken owner fails queued commands and drops completions."""
        if isinstance(item, _Command) and item.future.set_running_or_notify_cancel():
            item.future.set_exception(self._broken)

    def _publish_pool_metrics(self) -> None:
        for tier, pool in self.pools.items():
            s = pool.status()
            self.metrics.set_pool(tier, s.active, s.inactive, s.reset, s.evictions)

    def _call(self, fn: Callable, deferred: bool = False, *, internal: bool = False) -> Future:
        """Post ``fn`` to the owner. ``internal`` calls (release, flush, status) are still
        accepted while :meth:`close` waits for pending transfers; none after the owner
        stopped (``ManagerClosedError``) or broke (``ManagerError``)."""
        command = _Command(fn, deferred)
        with self._state_lock:
            if self._stopped or (self._closed and not internal):
                raise ManagerClosedError("block manager is closed")
            if self._broken is not None:
                raise ManagerError(str(self._broken)) from self._broken.__cause__
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
            self._check_registrable(blocks)
            before = blocks.block_ids
            registered = g1.register(blocks, priority)
            new = [b.record() for b, slot in zip(registered.blocks, before)
                   if b.block_id == slot]
            try:
                self.coordinator.offload("G1", new)
            except BaseException:
                g1.release(registered)
                raise
            return registered
        return self._call(run)

    def _check_registrable(self, blocks: MutableBlocks) -> None:
        """Refuse (``InvalidBlockError``, nothing changed) blocks whose identity cannot be
        stored: hashes that are not unsigned 64-bit integers, a foreign block size."""
        g1 = self.pools["G1"]
        if not isinstance(blocks, MutableBlocks) or blocks.pool is not g1:
            raise InvalidBlockError("register takes the MutableBlocks of the G1 pool that "
                                    "allocate() returned")
        if blocks.released:
            raise InvalidBlockError("register: handle already released or registered")
        block_size = self.config.block_size
        for i, block in enumerate(blocks.blocks):
            if block.state is not BlockState.COMPLETE:
                continue                  # the pool refuses it with BlockStateError
            where = f"register: block {i} (G1 slot {block.block_id})"
            for name in ("sequence_hash", "local_hash", "parent_hash"):
                value = getattr(block, name)
                if not (_is_u64(value) or (name == "parent_hash" and value is None)):
                    raise InvalidBlockError(f"{where}: {name} {value!r} is not an unsigned "
                                            f"64-bit integer")
            record = block.cached_record
            if block.block_size != block_size or (record is not None
                                                  and record.block_size != block_size):
                size = record.block_size if record is not None else block.block_size
                raise InvalidBlockError(f"{where}: a {size}-token block, config.block_size "
                                        f"is {block_size}")

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
        """Give a handle of the G1 pool back (on the owner thread). After :meth:`close` (or
        once the manager broke) there is nothing to give back to: resolved at once."""
        if handle.pool is not self.pools["G1"]:
            raise ManagerError(f"handle of pool {handle.pool.tier} is not a G1 handle")
        try:
            return self._call(lambda: None if handle.released else handle.release(),
                              internal=True)
        except ManagerError:
            return _resolved(None)

    def evict(self, tier: str, sequence_hashes: Sequence[int]) -> "Future[list[int]]":
        """Drop idle blocks from ``tier`` (invalidation); returns the hashes dropped. Blocks
        in use, or (leaf-first policies) with registered children, are left alone."""
        if tier not in self.pools:
            raise InvalidBlockError(f"no tier {tier!r}; tiers are {sorted(self.pools)}")
        hashes = list(sequence_hashes)
        return self._call(lambda: self.pools[tier].reset_blocks(hashes))

    def add_observer(self, observer: RegistryObserver) -> "Future[None]":
        """Attach a registry observer (it runs on the owner thread; keep it cheap)."""
        return self._call(lambda: self.registry.add_observer(observer))

    # ------------------------------------------------------------------ bytes of G1
    def write_g1(self, block_ids: Sequence[int], payloads: Sequence[np.ndarray]) -> None:
        """Write each payload (``block_bytes`` of uint8, layer-major: layer, K/V, tokens,
        elements) into a G1 block the caller holds as ``MutableBlocks`` -- what an engine's
        forward pass does. Runs on the caller's thread (bytes, not pool state).

        Every id, block and payload is checked before anything is written
        (``InvalidBlockError``): ids in range, blocks held (allocated) and not registered
        (a registered block's bytes are shared and may be copied right now), sizes right."""
        ids = self._check_g1_ids(block_ids, "write_g1")
        payloads = list(payloads)
        if len(payloads) != len(ids):
            raise InvalidBlockError(f"write_g1: {len(ids)} block ids but {len(payloads)} "
                                    f"payloads")
        g1 = self.pools["G1"]
        for block_id in ids:
            block = g1.block(block_id)
            if block.ref_count <= 0 or block.state is BlockState.REGISTERED:
                why = "registered" if block.state is BlockState.REGISTERED else "not held"
                raise InvalidBlockError(
                    f"write_g1: G1 block {block_id} is {why}; write only blocks you hold from "
                    f"allocate(), before register()")
        regions, chunk, spans = self._g1_chunks()
        size = len(spans) * chunk
        data = []
        for i, payload in enumerate(payloads):
            flat = np.asarray(payload).reshape(-1).view(np.uint8)
            if flat.size != size:
                raise InvalidBlockError(f"write_g1: payload {i} (block {ids[i]}) has "
                                        f"{flat.size} bytes, a block has {size}")
            data.append(flat)
        for block_id, flat in zip(ids, data):
            for i, (region, offset_of) in enumerate(spans):
                start = offset_of(block_id)
                part = flat[i * chunk:(i + 1) * chunk]
                dst = regions[region]
                if isinstance(dst, np.ndarray):
                    dst[start:start + chunk] = part
                else:   # device memory: one host-to-device copy
                    dst[start:start + chunk].copy_(torch.from_numpy(np.array(part)))

    def read_g1(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Copies of G1 blocks' payloads (same byte order as :meth:`write_g1`); ids out of
        range raise ``InvalidBlockError``."""
        ids = self._check_g1_ids(block_ids, "read_g1")
        regions, chunk, spans = self._g1_chunks()
        out = []
        for block_id in ids:
            data = np.empty(len(spans) * chunk, dtype=np.uint8)
            for i, (region, offset_of) in enumerate(spans):
                start = offset_of(block_id)
                src = regions[region]
                part = src[start:start + chunk]
                data[i * chunk:(i + 1) * chunk] = (part if isinstance(src, np.ndarray)
                                                   else part.cpu().numpy())
            out.append(data)
        return out

    def _check_g1_ids(self, block_ids: Sequence[int], what: str) -> list[int]:
        capacity = self._storages["G1"].config.num_blocks
        ids = list(block_ids)
        for i, block_id in enumerate(ids):
            if isinstance(block_id, bool) or not isinstance(block_id, numbers.Integral) \
                    or not 0 <= block_id < capacity:
                raise InvalidBlockError(f"{what}: block_ids[{i}] = {block_id!r} is not a G1 "
                                        f"block id (0 <= id < {capacity})")
        return [int(b) for b in ids]

    def _g1_chunks(self):
        """(regions, chunk bytes, per layer and K/V: (region, block id -> offset)). CPU
        regions are numpy views (no copy); device regions stay tensors (copied through the
        host by write_g1/read_g1)."""
        cached = getattr(self, "_g1_chunk_cache", None)
        if cached is None:
            g1 = self._storages["G1"]
            layout, cfg = g1.layout, g1.config
            regions = [r.numpy() if r.device.type == "cpu" else r for r in g1.memory.regions]
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
        """A future resolved once no transfer is pending (offloads included); resolved at
        once after :meth:`close`, failed with ``ManagerError`` if the manager broke."""
        def run(future: Future) -> None:
            if self.coordinator.idle:
                future.set_result(None)
            else:
                self._idle_waiters.append(future)
        try:
            return self._call(run, deferred=True, internal=True)
        except ManagerClosedError:
            return _resolved(None)
        except ManagerError as exc:
            return _resolved(error=exc)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until no transfer is pending (``flush().result(timeout)``); on timeout
        (``TimeoutError``) the wait is withdrawn."""
        future = self.flush()
        try:
            future.result(timeout)
        except TimeoutError:
            try:
                self._call(lambda: self._forget_waiter(future), internal=True)
            except ManagerError:
                pass
            raise

    def _forget_waiter(self, future: Future) -> None:
        if future in self._idle_waiters:
            self._idle_waiters.remove(future)

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
        if tier not in self._storages:
            raise InvalidBlockError(f"no tier {tier!r}; tiers are {sorted(self._storages)}")
        return self._storages[tier]

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Wait for pending transfers, stop the owner thread and the transfer engine, free
        storages (the G3 slab file is deleted) and stop the metrics endpoint. Idempotent; a
        concurrent second call returns once the first finished. Do not call it from a callback
        running on the owner thread."""
        with self._close_lock:
            first = not self._closed
            self._closed = True
        if not first:
            self._close_done.wait()
            return
        try:
            if self._broken is None:
                self.flush().result()
        except ManagerError:
            pass            # broke while waiting: stop anyway
        finally:
            try:
                with self._state_lock:   # nothing can be posted behind the stop marker
                    self._stopped = True
                    self._queue.put(_STOP)
                self._owner.join()
                self.engine.close()
                self.metrics.close()
                self._close_storages()
            finally:
                self._close_done.set()

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
