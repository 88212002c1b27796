"""``KvBlockManager``: kvstrata in one process -- pools, storages and transfers behind futures.

(Over 600 lines on purpose: one concern, the public API of one class; each of its two dozen
verbs is a short check plus a call posted to the owner thread, and they share its wiring.)

It wires four things together and adds nothing to their decisions:

* a :class:`~kvstrata.placement.Planner` (owned top tier) that decides every placement;
* one storage per tier, each built by its kind (:mod:`kvstrata.kinds`), and a
  :class:`~kvstrata.physical.TransferEngine` that copies bytes between them;
* an :class:`~kvstrata.placement.EngineExecutor` that runs the planner's plans on the engine
  and posts each result back;
* an :class:`~.owner.OwnerThread`, the one thread that touches the planner and its pools.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch

from ..config import ConfigError, KvConfig, tenant_problem
from ..logical.block import BlockState
from ..logical.handles import ImmutableBlocks, MutableBlocks, _Blocks
from ..logical.registry import BlockRegistry, RegistryObserver
from ..metrics import ManagerMetrics
from ..physical import FileOps, Storage, TransferEngine
from ..kinds import StorageOptions, TierSetupError, build_storages, cost_priors
from ..placement import EngineExecutor, OnboardResult, Planner
from ..placement.costs import CostModel
from ..protocol.results import TransferResult
from ..types import BlockRecord, first_bad_record, hash_problem, is_u64
from ..tiers import TierKind, first_of_kind
from .errors import (InvalidBlockError, InvalidConfigError, ManagerClosedError,
                     ManagerConfigError, ManagerError)
from .g1_bytes import G1Bytes
from .owner import OwnerThread, resolved
from ..physical.storage.objects import ObjectStorage
from ..physical.storage.s3client import S3Config
from .catalog import StoreLister

if TYPE_CHECKING:
    from ..remote.exporter import BlockExporter
    from ..remote.importer import BlockSetImporter, RemotePeer

__all__ = ["KvBlockManager"]

log = logging.getLogger(__name__)


class KvBlockManager:
    """A tiered KV block manager for one process: G1 device memory (or a CPU stand-in), G2
    host RAM, G3 a slab file on local disk.

    Blocks the engine computes into G1 are registered by their sequence hashes and copied
    down the tiers in the background (write-through); a returning prefix is brought back
    into G1 with :meth:`onboard`, its bytes verified. Every method is thread-safe and
    returns a ``concurrent.futures.Future`` (except the byte and status helpers)::

        from kvstrata import KvBlockManager, KvConfig

        with KvBlockManager(KvConfig()) as mgr:
            blocks = mgr.allocate(len(records)).result()
            mgr.write_g1(blocks.block_ids, payloads)      # the engine computes the KV
            blocks.apply_token_blocks(records)            # their hashes (kvstrata.tokens)
            mgr.release(mgr.register(blocks).result())    # copied to G2, G3 in background
            mgr.flush().result()
            with mgr.onboard([r.sequence_hash for r in records]).result() as loaded:
                ...                                       # loaded.block_ids: verified bytes

    **Threading.** One owner thread mutates the pools; calls post to it, transfer workers
    post their results to it. No lock is held across I/O. Callbacks attached to returned
    futures may run on the owner thread: they must not block on another future of the same
    manager.

    **Handles.** Handles handed out (``allocate``, ``register``, ``match``, ``onboard``)
    belong to the G1 pool; give them back with :meth:`release` (or
    :meth:`OnboardResult.release`), which runs on the owner thread. Do not call
    ``handle.release()`` from your own thread; a dropped handle is returned safely by its
    finalizer.

    Parameters (all keyword-only except ``config``):

    * ``kv_caches`` -- the engine's per-layer KV tensors to wrap as G1 (zero-copy); their
      block count becomes G1's size, their page size must equal ``config.block_size``.
      Without it G1 is allocated (``g1_layout``: ``outer_contiguous``, ``block_contiguous``
      or ``fully_contiguous``) on ``device`` (CUDA if available, else a CPU stand-in).
    * ``disk_dir`` -- directory of the G3 slab file; default ``config.disk_dir``, then
      ``tiers["G3"].path``, else a temporary directory removed on :meth:`close`. In a named
      directory G3 is durable (unless ``durable_disk=False``): it is kept on :meth:`close`
      and the next manager of the same model and geometry there recovers its blocks (each
      verified when first read), announcing them to ``observers`` as stored. Two managers
      never share one: the second gets ``ManagerConfigError``.
    * ``observers`` -- registry observers attached before anything is stored or recovered
      (e.g. an event publisher); more can be added later with :meth:`add_observer`.
    * ``object_store`` -- the S3-compatible store of a G4 tier (an ``S3Config``), instead of
      ``tiers.G4.url``. G4 is shared: every manager of the same model, geometry and tenant
      on that bucket sees the blocks the others put; the store is listed at start and every
      ``list_interval`` seconds (None: only at start and on :meth:`refresh_catalogs`).
    * ``secret`` -- the deployment's secret that keys (and with ``encrypt_at_rest``
      encrypts) the blocks stored in G3 and G4 (:mod:`kvstrata.secret`); default: from the
      environment. A G4 tier needs one.
    * ``verify_host_reads`` -- re-hash G2 bytes on every read from G2 (G3 reads always verify;
      default on: a G2 byte changed after the offload is never loaded; off, a G2 slot is
      sealed without a checksum and hashed on its way to G3).
    * ``max_host_bytes`` -- refuse (``ManagerConfigError``) a G2 bigger than this.
    * ``o_direct`` / ``file_ops`` -- passed to :class:`~kvstrata.physical.DiskStorage`
      (``file_ops`` is the fault-injection seam).
    * ``metrics_registry`` -- a ``prometheus_client.CollectorRegistry`` (default: a private
      one); ``metrics_port`` -- serve ``/metrics`` on 127.0.0.1:port (0 = any free port; off
      by default), the bound port is :attr:`metrics_port`.
    * ``workers_per_path`` -- transfer worker threads per path.
    * ``rank`` / ``world_size`` -- this process's tensor-parallel rank and the ranks a model's
      KV heads are split over: each rank's stored blocks are its own (a durable G3 home per
      rank in one ``disk_dir``).

    :class:`~kvstrata.manager.engine_owned.EngineOwnedManager` is the same manager over an
    engine's own KV memory, whose blocks the engine allocates (SGLang's host pool).
    """

    engine_owns_g1 = False
    """Whether G1's blocks are the engine's to allocate (a subclass's choice): the planner
    then fills and reads the engine's block ids it is given and keeps no G1 pool."""

    def __init__(self, config: KvConfig | None = None, *,
                 kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | None = None,
                 kv_layout: str = "auto", g1_layout: str = "outer_contiguous",
                 device: str | torch.device | None = None, disk_dir: str | None = None,
                 verify_host_reads: bool = True, max_host_bytes: int | None = None,
                 o_direct: bool | None = None, file_ops: FileOps | None = None,
                 metrics_registry=None, metrics_port: int | None = None,
                 workers_per_path: int = 1, durable_disk: bool = True,
                 observers: Sequence[RegistryObserver] = (),
                 object_store: "S3Config | None" = None,
                 list_interval: float | None = 10.0, secret: bytes | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        try:
            config = config or KvConfig()
            if disk_dir is not None:      # the caller's directory wins over the config's
                config = replace(config, disk_dir=disk_dir)
            config = config.validate()
        except ConfigError as exc:
            raise InvalidConfigError(exc.problems) from None
        self._owner = OwnerThread("kvstrata-manager-owner", self._handle_result,
                                  self._after_step, self._fail_onboards)
        self._onboards: dict[int, Future] = {}
        """Onboard tickets of the planner -> the futures their callers wait on."""
        self._close_lock = threading.Lock()
        self._close_done = threading.Event()
        self.metrics = ManagerMetrics(metrics_registry)
        self.metrics_port: int | None = None
        self.engine: TransferEngine | None = None
        self._storages = None
        self._listers: list[StoreLister] = []
        self._importers: dict[str, "BlockSetImporter"] = {}
        self._fetcher: ThreadPoolExecutor | None = None
        try:
            if metrics_port is not None:   # first: a busy port must not leak threads or dirs
                try:
                    self.metrics_port = self.metrics.serve(metrics_port)
                except OSError as exc:
                    raise ManagerConfigError(
                        f"cannot serve metrics on 127.0.0.1:{metrics_port}: {exc}") from exc
            options = StorageOptions(
                kv_caches=kv_caches, kv_layout=kv_layout, g1_layout=g1_layout,
                device=device, verify_host_reads=verify_host_reads,
                max_host_bytes=max_host_bytes, o_direct=o_direct, file_ops=file_ops,
                durable_disk=durable_disk, object_store=object_store, secret=secret,
                rank=rank, world_size=world_size)
            try:
                self._storages = build_storages(config, options)
            except TierSetupError as exc:
                raise ManagerConfigError(str(exc)) from exc
            self.config = self._storages.config
            self.fingerprint = options.compatibility(self.config).fingerprint
            """What this manager's blocks were computed for (model, geometry, rank:
            :mod:`kvstrata.compat`); its exports carry it and its importer requires it."""
            self.planner = Planner(self.config, listeners=[self.metrics], release=self.release,
                                   costs=CostModel(cost_priors()),
                                   engine_owns_top=self.engine_owns_g1)
            for observer in observers:
                self.planner.registry.add_observer(observer)
            for tier, entries in self._storages.recovered().items():
                self.planner.restore(tier, entries)
            for tier, storage in self._storages.by_tier.items():
                if isinstance(storage, ObjectStorage):   # shared: learn what others put
                    lister = StoreLister(storage, tier, self.config.block_size,
                                         self._learn_later, list_interval,
                                         limit=self.config.tier_blocks(tier))
                    self._listers.append(lister)
                    lister.refresh(self.planner.learn)        # at start: on this thread
            self.pools = self.planner.pools
            self._top = self.planner.top
            self._g1 = G1Bytes(self._storages.by_tier[self._top])
            self.engine = TransferEngine(self._storages.by_tier,
                                         workers_per_path=workers_per_path)
            self._executor = EngineExecutor(self.engine, self._owner.post)
            for tier, storage in self._storages.by_tier.items():
                self.metrics.set_capacity(tier, storage.num_blocks, storage.status().bytes)
            self._owner.start()
            for lister in self._listers:
                lister.start()
            _track_for_exit(self)
        except BaseException:
            for lister in self._listers:
                lister.close()
            if self.engine is not None:
                self.engine.close()
            self.metrics.close()
            if self._storages is not None:
                self._storages.close()
            raise

    # ------------------------------------------------------------------ owner thread steps
    def _handle_result(self, result: TransferResult) -> None:
        self.planner.complete([result])
        self._executor.settled(result)

    def _after_step(self) -> None:
        """After every item: submit new plans, deliver finished onboards, wake idle waiters,
        publish pool gauges."""
        planner = self.planner
        planner.settle()                  # handles released by the last command
        plans = planner.take_plans()
        if plans:
            self._executor.submit(plans)
        for result in planner.take_finished():
            future = self._onboards.pop(result.ticket, None)
            if future is None or future.done():
                if result.blocks is not None and not result.blocks.released:
                    result.blocks.pool.release(result.blocks)
            else:
                future.set_result(result)
        if planner.idle and self._owner.idle_waiters:
            self._owner.wake_idle()
        for tier, pool in self.pools.items():
            s = pool.status()
            self.metrics.set_pool(tier, s.active, s.inactive, s.reset, s.evictions)

    def learn(self, tier: str, records: Sequence[BlockRecord]) -> "Future[int]":
        """Tell this manager that the shared ``tier`` (G4) holds ``records``: another worker
        stored them (its stored events say so, or a listing of the store). They become
        loadable here; the future holds how many were new (``Planner.learn``)."""
        records = list(records)
        if tier not in self.pools or not isinstance(self._storages.by_tier.get(tier),
                                                    ObjectStorage):
            raise InvalidBlockError(f"learn: {tier!r} is not a shared object tier of this "
                                    f"manager")
        bad = first_bad_record(records, self.config.block_size)
        if bad is not None:
            raise InvalidBlockError(f"learn: records[{bad}] = {records[bad]!r:.120} is not a "
                                    f"block of {self.config.block_size} tokens with u64 hashes")
        return self._call(lambda: self.planner.learn(tier, records))

    def _learn_later(self, tier: str, records) -> None:
        """From a store lister's thread: let the owner thread learn ``records``."""
        try:
            self.learn(tier, records)
        except ManagerError:
            pass                          # closing: nothing to learn any more

    def refresh_catalogs(self) -> int:
        """List every shared object tier now (as the background listing does every
        ``list_interval`` seconds) and learn what others stored; returns the blocks listed.
        Blocks until the listing is done and learned."""
        total = 0
        for lister in self._listers:
            total += lister.refresh()
        self._call(lambda: None).result()
        return total

    def _fail_onboards(self, error: ManagerError) -> None:
        onboards, self._onboards = self._onboards, {}
        for future in onboards.values():
            if not future.done():
                future.set_exception(error)

    def _call(self, fn, deferred: bool = False, *, internal: bool = False) -> Future:
        return self._owner.call(fn, deferred, internal=internal)

    # ------------------------------------------------------------------ G1 blocks
    def allocate(self, count: int) -> "Future[MutableBlocks]":
        """``count`` G1 blocks (Reset) for KV the engine is about to compute; evicts inactive
        G1 blocks by policy. Fails with ``PoolExhaustedError`` if too many are in use; a
        count that is not an integer >= 0 is an ``InvalidBlockError`` at once."""
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise InvalidBlockError(f"allocate: count must be an integer >= 0, got {count!r}")
        count = int(count)
        return self._call(lambda: self.pools[self._top].allocate(count))

    def register(self, blocks: MutableBlocks, priority: int = 0,
                 tenant: str | None = None) -> "Future[ImmutableBlocks]":
        """Register Complete G1 blocks (their bytes are written) and start offloading the new
        ones down the tiers. ``blocks`` is consumed; the future holds handles on the
        registered blocks (a hash already held is deduplicated to the existing block).
        ``tenant`` (default: ``config.tenant``) is whose they are: the config's tenant quotas
        apply to them in the lower tiers (:mod:`kvstrata.placement.tenants`)."""
        tenant = self.config.tenant if tenant is None else tenant
        if tenant_problem(tenant):
            raise InvalidBlockError(f"register: {tenant_problem(tenant)}")

        def run() -> ImmutableBlocks:
            self._check_registrable(blocks)
            return self.planner.register(blocks, priority, tenant)
        return self._call(run)

    def _check_registrable(self, blocks: MutableBlocks) -> None:
        """Refuse (``InvalidBlockError``, nothing changed) blocks whose identity cannot be
        stored: hashes that are not unsigned 64-bit integers, a foreign block size."""
        if not isinstance(blocks, MutableBlocks) or blocks.pool is not self.pools[self._top]:
            raise InvalidBlockError("register takes the MutableBlocks of the G1 pool that "
                                    "allocate() returned")
        if blocks.released:
            raise InvalidBlockError("register: handle already released or registered")
        block_size = self.config.block_size
        for i, block in enumerate(blocks.blocks):
            if block.state is not BlockState.COMPLETE:
                continue                  # the pool refuses it with BlockStateError
            where = f"register: block {i} (G1 slot {block.block_id})"
            problem = hash_problem(block)
            if problem is not None:
                raise InvalidBlockError(f"{where}: {problem}")
            record = block.cached_record
            if block.block_size != block_size or (record is not None
                                                  and record.block_size != block_size):
                size = record.block_size if record is not None else block.block_size
                raise InvalidBlockError(f"{where}: a {size}-token block, config.block_size "
                                        f"is {block_size}")

    def match(self, sequence_hashes: Sequence[int]) -> "Future[ImmutableBlocks]":
        """Handles on the longest prefix of ``sequence_hashes`` already in G1."""
        hashes = _hashes(sequence_hashes, "match")
        return self._call(lambda: self.pools[self._top].match(hashes))

    def locate(self, sequence_hashes: Sequence[int]) -> "Future[list[str]]":
        """For the longest prefix held in any tier, the fastest tier holding each block
        (no side effect)."""
        hashes = _hashes(sequence_hashes, "locate")
        return self._call(lambda: self.planner.lookup(hashes))

    def onboard(self, sequence_hashes: Sequence[int],
                cost_aware: bool = False) -> "Future[OnboardResult]":
        """Bring the longest prefix of ``sequence_hashes`` held in any tier into G1.

        The future resolves when every needed copy completed, with an
        :class:`~kvstrata.placement.OnboardResult`: G1 handles on the verified prefix, the
        tier each block came from, and the blocks whose load failed (dropped from their
        tier). Admission policies that learn from requests see the hashes. A hash that is
        not an unsigned 64-bit integer is an ``InvalidBlockError`` at once.

        ``cost_aware``: load only as much of the held prefix as the cost model estimates
        faster than recomputing it (:meth:`worth_loading`, the vLLM connector's decision;
        set the engine's rate with :meth:`assume_prefill`); the rest is left to recompute.
        """
        hashes = _hashes(sequence_hashes, "onboard")

        def run(future: Future) -> None:
            self._onboards[self._prepare_load(hashes, cost_aware)] = future
        return self._call(run, deferred=True)

    def _prepare_load(self, hashes: list[int], cost_aware: bool,
                      engine_block_ids: list[int] | None = None) -> int:
        """Show the whole request to the policies that learn from requests, then start
        loading its held prefix, or as much of it as the cost model would load (owner
        thread); returns the onboard's ticket."""
        self.planner.observe_request(hashes)
        wanted = self._worth_loading(hashes) if cost_aware else hashes
        if engine_block_ids is None:
            return self.planner.prepare_onboard(wanted, observe=False)
        return self.planner.prepare_onboard(wanted, engine_block_ids[:len(wanted)],
                                            observe=False)

    def _worth_loading(self, hashes: list[int]) -> list[int]:
        """The part of ``hashes`` the cost model would load (owner thread)."""
        tiers = self.planner.lookup(hashes)
        return hashes[:self.planner.costs.worth_loading(
            tiers, self._top, self.config.bytes_per_block, self.config.block_size)]

    def release(self, handle: _Blocks) -> "Future[None]":
        """Give a handle of the G1 pool back (on the owner thread). After :meth:`close` (or
        once the manager broke) there is nothing to give back to: resolved at once."""
        if handle.pool is not self.pools[self._top]:
            raise ManagerError(f"handle of pool {handle.pool.tier} is not a G1 handle")
        try:
            return self._call(lambda: None if handle.released else handle.release(),
                              internal=True)
        except ManagerError:
            return resolved(None)

    def clear(self) -> "Future[int]":
        """Drop every idle block of the tiers below G1 (a "cleared" event where nothing was
        in use; blocks in use stay), for good: a durable G3 journals it, so a restart does
        not bring them back (after a change of weights, say). The future gives how many were
        dropped. Objects in a shared G4 stay in the store (other workers may use them): this
        worker forgets them until a listing finds them again. The future fails with an
        ``OSError`` if a durable G3 could not record it (a full disk): the blocks are served
        no more, but a restart before their slots are reused would bring them back."""
        def run() -> int:
            dropped = 0
            failed: OSError | None = None
            for tier, pool in self.pools.items():
                if tier == self._top:
                    continue
                gone = pool.clear_slots()
                dropped += len(gone)
                forget = getattr(self._storages.by_tier[tier], "forget", None)
                if forget is not None and gone:
                    try:
                        forget(gone)
                    except OSError as exc:     # every tier is cleared all the same
                        failed = failed or exc
            if failed is not None:
                raise failed
            return dropped
        return self._call(run)

    def evict(self, tier: str, sequence_hashes: Sequence[int]) -> "Future[list[int]]":
        """Drop idle blocks from ``tier`` (invalidation); returns the hashes dropped. Blocks
        in use, or (leaf-first policies) with registered children, are left alone. A durable
        G3 journals it, so a restart does not bring them back; the future fails with an
        ``OSError`` if it could not (a full disk: as :meth:`clear`)."""
        if tier not in self.pools:
            raise InvalidBlockError(f"no tier {tier!r}; tiers are {sorted(self.pools)}")
        hashes = _hashes(sequence_hashes, "evict")

        def run() -> list[int]:
            pool = self.pools[tier]
            slots = {h: block.block_id for h in hashes
                     if (block := pool.lookup(h)) is not None}
            dropped = pool.reset_blocks(hashes)
            forget = getattr(self._storages.by_tier[tier], "forget", None)
            if forget is not None and dropped and tier != self._top:
                forget([slots[h] for h in dropped])
            return dropped
        return self._call(run)

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
        self._check_open("write_g1")
        with self._g1.in_use("write_g1"):            # a close() meanwhile waits for it
            ids = self._g1.check_ids(block_ids, "write_g1")
            flat = self._g1.check_payloads(ids, payloads, "write_g1")
            pool = self.pools[self._top]
            for block_id in ids:
                block = pool.block(block_id)
                if block.ref_count <= 0 or block.state is BlockState.REGISTERED:
                    self._check_open("write_g1")     # a close() under way let go of it
                    why = "registered" if block.state is BlockState.REGISTERED else "not held"
                    raise InvalidBlockError(
                        f"write_g1: G1 block {block_id} is {why}; write only blocks you hold "
                        f"from allocate(), before register()")
            self._g1.write(ids, flat)

    def read_g1(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Copies of G1 blocks' payloads (same byte order as :meth:`write_g1`); ids out of
        range raise ``InvalidBlockError``; after :meth:`close`, ``ManagerClosedError``."""
        self._check_open("read_g1")
        with self._g1.in_use("read_g1"):             # a close() meanwhile waits for it
            return self._g1.read(self._g1.check_ids(block_ids, "read_g1"))

    def _check_open(self, what: str) -> None:
        if self._owner.closed:
            raise ManagerClosedError(f"{what}: the manager is closed")

    # ------------------------------------------------------------------ waiting, status
    def flush(self) -> "Future[None]":
        """A future resolved once no transfer is pending (offloads included); resolved at
        once after :meth:`close`, failed with ``ManagerError`` if the manager broke."""
        def run(future: Future) -> None:
            if self.planner.idle:
                future.set_result(None)
            else:
                self._owner.idle_waiters.append(future)
        try:
            return self._call(run, deferred=True, internal=True)
        except ManagerClosedError:
            return resolved(None)
        except ManagerError as exc:
            return resolved(error=exc)

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
        if future in self._owner.idle_waiters:
            self._owner.idle_waiters.remove(future)

    def status(self) -> dict[str, Any]:
        """Per tier: pool counts (capacity, active, inactive, reset, evictions), storage
        status (kind, bytes, stand_in, o_direct, path, ...), quarantined blocks; plus
        ``stand_in`` (G1 is a CPU tensor), ``transfers_pending``, ``costs`` (per path the
        learned bandwidth and overhead, :mod:`kvstrata.placement.costs`), ``block_bytes``,
        ``disk_dir``, and with tenant quotas ``tenants``: per tier, the blocks each tenant
        holds, and per ``"tier:label"`` the blocks quotas evicted and refused
        (:mod:`kvstrata.placement.tenants`)."""
        def run() -> dict[str, Any]:
            storages = self._storages.by_tier
            tiers = {tier: {"pool": asdict(pool.status()),
                            "storage": storages[tier].status().to_dict(),
                            "quarantined": self.planner.quarantined(tier)}
                     for tier, pool in self.pools.items()}
            g1 = storages[self._top].status()
            disk = next((s for s in storages.values() if hasattr(s, "path")), None)
            return {"tiers": tiers, "stand_in": g1.stand_in,
                    "transfers_pending": self.planner.pending,
                    "costs": self.planner.costs.snapshot(),
                    "block_bytes": g1.block_bytes,
                    "disk_dir": str(disk.path.parent) if disk is not None else None,
                    **self._tenants_status()}
        return self._call(run, internal=True).result()

    def _tenants_status(self) -> dict[str, Any]:
        ledger = self.planner.tenants
        if ledger is None:
            return {}
        return {"tenants": {"held": ledger.usage(),
                            "evicted": {f"{t}:{label}": n for (t, label), n in
                                        ledger.evicted.items()},
                            "refused": {f"{t}:{label}": n for (t, label), n in
                                        ledger.refused.items()}}}

    def worth_loading(self, sources: Sequence[str]) -> "Future[tuple[int, float]]":
        """For a prefix held in ``sources`` (the tier of each block), how many blocks the cost
        model would load and the seconds it estimates that saves against recomputing them
        (:meth:`~kvstrata.placement.costs.CostModel.worth_loading`); on the owner thread."""
        sources = list(sources)

        def run() -> tuple[int, float]:
            costs, top = self.planner.costs, self._top
            bb, bs = self.config.bytes_per_block, self.config.block_size
            k = costs.worth_loading(sources, top, bb, bs)
            return k, costs.saving(sources, top, bb, bs, k)
        return self._call(run, internal=True)

    def assume_prefill(self, tokens_per_s: float) -> "Future[None]":
        """Take ``tokens_per_s`` as the engine's prefill rate in the cost model."""
        return self._call(lambda: self.planner.costs.assume_prefill(tokens_per_s),
                          internal=True)

    def transfer_stats(self) -> dict[str, dict[str, float]]:
        """Per path: plans, blocks, bytes, failed blocks, busy seconds, latency seconds,
        GB/s."""
        return self._call(lambda: {p: s.as_dict() for p, s in
                                   sorted(self.planner.stats.paths.items())},
                          internal=True).result()

    def export(self, tier: str | None = None, *, name: str | None = None, host: str = "127.0.0.1",
               port: int = 0, fingerprint: str | None = None) -> "BlockExporter":
        """Export ``tier`` (host memory) to other processes over NIXL: a
        :class:`~kvstrata.remote.BlockExporter` whose leases pin blocks in this manager's
        pool (on the owner thread) until released or expired. Its block set carries
        ``fingerprint`` (default :attr:`fingerprint`), which an importer must match. Close
        it before the manager."""
        from ..remote.exporter import BlockExporter

        self._check_open("export")
        tier = tier or first_of_kind(TierKind.HOST)
        storage = self.storage(tier)
        pool = self.pools[tier] if tier in self.pools else None
        if pool is None or not hasattr(storage, "ensure_checksums"):
            raise InvalidBlockError(f"tier {tier!r} is not a host-memory tier kvstrata owns")

        def pin(hashes: Sequence[int]):
            def run():
                held = pool.match_length(hashes)
                if not held:
                    return [], None
                handle = pool.acquire(hashes[:held])
                checksums = storage.ensure_checksums(list(handle.block_ids))
                return list(zip(hashes[:held], handle.block_ids, checksums)), handle
            return self._call(run, internal=True).result()

        def unpin(handle) -> None:
            def run() -> None:
                if not handle.released:
                    handle.release()
                self.planner.settle()        # a block freed here may be what a copy waits for
            self._call(run, internal=True).result()

        return BlockExporter(name or f"kvstrata-{tier.lower()}-{id(self):x}", tier, storage,
                             pin, unpin, host=host, port=port,
                             fingerprint=self.fingerprint if fingerprint is None else fingerprint)

    def importer(self, tier: str | None = None, *, fingerprint: str | None = None) -> "BlockSetImporter":
        """This manager's reader of other workers' exported memory, into ``tier`` (host
        memory): connect it to an exporter and hand the peer to :meth:`fetch_remote`. One per
        tier, closed with the manager. It connects only to exporters whose block set
        carries ``fingerprint`` (default :attr:`fingerprint`: blocks computed for the same
        model, geometry and rank; another model's KV passes every checksum)."""
        from ..remote.importer import BlockSetImporter

        self._check_open("importer")
        tier = tier or first_of_kind(TierKind.HOST)
        if tier not in self._importers:
            storage = self.storage(tier)
            if tier not in self.pools or not hasattr(storage, "seal"):
                raise InvalidBlockError(f"tier {tier!r} is not a host-memory tier kvstrata owns")
            self._importers[tier] = BlockSetImporter(
                storage, fingerprint=self.fingerprint if fingerprint is None else fingerprint)
        return self._importers[tier]

    def fetch_remote(self, peer: "RemotePeer", records: Sequence[BlockRecord],
                     ttl: float = 10.0, tenant: str | None = None) -> "Future[int]":
        """Bring a prefix another worker holds into this manager's tier over NIXL instead of
        recomputing it: lease the longest prefix of ``records`` (after the part this tier
        already holds) from ``peer``, read it into free slots, verified, and register it
        (then offered down the tiers like any stored block; :meth:`onboard` loads it into
        G1) for ``tenant`` (default ``config.tenant``; blocks beyond its quota of the tier
        are not kept). The future gives the number of blocks fetched and kept; it fails with
        :class:`~kvstrata.remote.RemoteReadError` or :class:`~kvstrata.remote.LeaseError`
        with nothing registered and the slots freed."""
        records = list(records)
        bad = first_bad_record(records, self.config.block_size)
        if bad is not None:
            raise InvalidBlockError(f"records[{bad}] is not a block record of this manager")
        tenant = self.config.tenant if tenant is None else tenant
        if tenant_problem(tenant):
            raise InvalidBlockError(f"fetch_remote: {tenant_problem(tenant)}")
        tier = next((t for t, imp in self._importers.items()
                     if imp is getattr(peer, "importer", None)), None)
        if tier is None:
            raise InvalidBlockError("peer was not connected through this manager's importer()")
        pool = self.pools[tier]
        hashes = [r.sequence_hash for r in records]

        def run() -> int:
            held = self._call(lambda: pool.match_length(hashes), internal=True).result()
            wanted = records[held:]
            if not wanted:
                return 0
            lease = peer.lease([r.sequence_hash for r in wanted], ttl)
            try:
                if not lease.blocks:
                    return 0

                def take_slots():
                    # the quota first: taking slots evicts idle blocks of any tenant; what
                    # it has no room for is counted once, as refused for quota
                    fits = self.planner.room_for(tier, wanted[:len(lease.blocks)], tenant,
                                                 refuse=True)
                    return pool.allocate(fits) if fits else None
                slots = self._call(take_slots, internal=True).result()
                if slots is None:
                    return 0
                count = len(slots)
                try:
                    peer.read(lease, slots.block_ids)
                except BaseException:
                    self._call(lambda: pool.release(slots), internal=True).result()
                    raise

                def register() -> int:
                    slots.apply_token_blocks(wanted[:count])
                    kept = self.planner.register_fetched(slots, tenant=tenant)
                    held = len(kept)
                    kept.release()
                    return held
                return self._call(register, internal=True).result()
            finally:
                peer.release(lease)

        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-fetch")
        return self._fetcher.submit(run)

    @property
    def registry(self) -> BlockRegistry:
        return self.planner.registry

    def storage(self, tier: str) -> Storage:
        """The storage of ``tier`` (tests and byte-level tools)."""
        storages = self._storages.by_tier
        if tier not in storages:
            raise InvalidBlockError(f"no tier {tier!r}; tiers are {sorted(storages)}")
        return storages[tier]

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Wait for pending transfers, stop the owner thread and the transfer engine, free
        storages (the G3 slab file is deleted) and stop the metrics endpoint. Idempotent; a
        concurrent second call returns once the first finished. Do not call it from a callback
        running on the owner thread: it would wait for itself (``ManagerError``)."""
        owner = self._owner
        if threading.current_thread() is owner.thread:
            raise ManagerError("close() called from a callback on the manager's own thread "
                               "would wait for that thread for ever: call it from another")
        with self._close_lock:
            first = not owner.closed
            owner.closed = True
        if not first:
            self._close_done.wait()
            return
        try:
            if owner.broken is None:
                self.flush().result()
        except ManagerError:
            pass            # broke while waiting: stop anyway
        finally:
            try:
                for lister in self._listers:
                    lister.close()
                if self._fetcher is not None:
                    self._fetcher.shutdown(wait=True)
                for importer in self._importers.values():
                    importer.close()
                owner.stop()
                self.engine.close()
                self.metrics.close()
                self._g1.close()
                self._storages.close()
            finally:
                self._close_done.set()

    def __enter__(self) -> "KvBlockManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hashes(sequence_hashes: Sequence[int], what: str) -> list[int]:
    """Sequence hashes as a list, each an unsigned 64-bit integer (``InvalidBlockError``)."""
    if isinstance(sequence_hashes, (str, bytes)):
        raise InvalidBlockError(f"{what}: expected a sequence of hashes, got "
                                f"{type(sequence_hashes).__name__}")
    try:
        hashes = list(sequence_hashes)
    except TypeError:
        raise InvalidBlockError(f"{what}: expected a sequence of hashes, got "
                                f"{type(sequence_hashes).__name__}") from None
    for i, h in enumerate(hashes):
        if not is_u64(h):
            if isinstance(h, numbers.Integral) and not isinstance(h, bool) \
                    and 0 <= int(h) < 1 << 64:
                hashes[i] = int(h)            # numpy integers
                continue
            raise InvalidBlockError(f"{what}: sequence_hashes[{i}] = {h!r} is not an "
                                    f"unsigned 64-bit integer")
    return hashes


_OPEN: "weakref.WeakSet[KvBlockManager]" = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook = False


def _track_for_exit(manager: KvBlockManager) -> None:
    """A manager not closed by its user is closed at interpreter exit, as :meth:`close`
    would: its pending writes land (a durable G3 keeps them), its slab and temporary
    directory are deleted, not left on disk.

    Two hooks: the interpreter shuts every thread pool down among threading's exit hooks,
    before it joins the threads still running (``concurrent.futures`` registers there, and
    they run last first), and a pool shut down refuses the writes still pending. So a hook
    among them, run before that, waits for every open manager's pending transfers; the
    managers are closed at ``atexit``, once the threads still running have ended (they may
    still be using them), which also closes one made after the first hook ran."""
    global _exit_hook
    with _exit_hook_lock:
        _OPEN.add(manager)
        if not _exit_hook:
            atexit.register(_close_open_managers)
            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                try:
                    register(_flush_open_managers)
                except RuntimeError:               # the interpreter is exiting already
                    pass
            _exit_hook = True


def _open_managers() -> list[KvBlockManager]:
    with _exit_hook_lock:          # another thread may be making one right now
        return list(_OPEN)


def _flush_open_managers() -> None:
    for manager in _open_managers():
        try:
            manager.flush().result()
        except Exception:                          # a broken or closed manager: closed later
            log.debug("kvstrata: flushing a manager at exit failed", exc_info=True)


def _close_open_managers() -> None:
    for manager in _open_managers():
        try:
            manager.close()
        except Exception:
            log.exception("kvstrata: closing a manager at exit failed")
