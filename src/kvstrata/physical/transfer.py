"""The transfer engine: executes :class:`TransferPlan` batches between tier storages.

Usage::

    engine = TransferEngine({"G1": device, "G2": host, "G3": disk, "G4": objects})
    future = engine.submit(TransferPlan(job_id, Endpoint("G1"), Endpoint("G2"), seq_hashes,
                                        src_block_ids=src_ids, dst_block_ids=dst_ids))
    result = future.result()
    engine.close()

* Storages are keyed by tier name; each tier's kind (:mod:`kvstrata.tiers`) says which
  storage class it must be, and a plan's pair of kinds picks its handler (device -> host,
  host -> device, host -> disk, disk -> host, disk -> device, host -> object, disk -> object,
  object -> host, object -> device). A new kind of tier is a new storage class plus its
  handlers here. The engine serves the endpoints of its own worker. Slot-addressed tiers are
  named by block ids in plans, key-addressed ones (G4) by keys (``src_keys``/``dst_keys``).
* One bounded queue and ``workers_per_path`` worker threads per path, so offload and onboard
  never wait behind each other; at most ``queue_depth + workers_per_path`` plans per path are
  in flight. :meth:`TransferEngine.submit` waits (sleeping) for room up to ``timeout`` and then
  raises :class:`EngineBusyError`. With ``store_nice``, the threads of paths away from the
  engine (stores) run at that CPU niceness: background work that yields to the engine's
  compute where the engine uses every core. With a ``pacer``
  (:class:`~kvstrata.physical.pacing.ForwardPacer`), the writes away from the engine that do
  not read its memory (host -> disk, host/disk -> object) also wait while the engine's
  forward runs: a disk plan before it starts, an object batch before each round of
  ``max_concurrency`` PUTs. The time a plan was held back is reported apart
  (``TransferResult.held_seconds``), not in ``seconds``.
* Each plan is one batched call per storage pair: a copy engine call between memory layouts
  (:mod:`~kvstrata.physical.copy`), coalesced ``preadv``/``pwritev`` for disk, concurrent
  requests for the object store.
* Every plan completes with a :class:`TransferResult` set on the returned
  ``concurrent.futures.Future``: the future is the only channel a result travels by (an
  owner that wants results on its own thread attaches a callback that posts them there, as
  :class:`~kvstrata.placement.EngineExecutor` does), so the engine keeps no result once its
  future is dropped. Failed blocks are reported per block, never raised through the future,
  so the owner handles every outcome in one place.
* Integrity: blocks written into G2/G3 are checksummed (xxh3-64) and their slot records the
  sequence hash only after the write succeeded; G4 objects carry the checksum and sequence
  hash in their header. Reads from G3 and G4 always verify, reads from G2 check the sequence
  hash and verify bytes when the host storage has ``verify_reads``. A block that fails is
  reported in ``failures``/``failed_sequence_hashes`` and its bytes are not used.
* No lock is held across I/O or copies; nothing busy-waits.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, Mapping

from ..protocol.layout import FullyContiguousLayout
from ..protocol.plans import TransferPlan
from ..protocol.results import TransferResult
from ..tiers import (Addressing, TierKind, UnknownTierError, is_onboard, ordered, path_name,
                     spec, split_path)
from .buffers import AlignedBuffer
from .copy import OFFLOAD, ONBOARD, CopyEngine, default_copy_engine
from .errors import (BlockFailure, BlockIOError, EngineBusyError, EngineClosedError,
                     FailureKind, StorageConfigError, TransferPlanError, raise_for_failures)
from .pacing import ForwardPacer
from .storage.base import BlockMemory, MemoryStorage, Storage
from .storage.disk import DIRECT_ALIGNMENT, DiskStorage
from .storage.host import HostStorage
from .storage.objects import ObjectStorage

__all__ = ["TransferEngine", "STORAGE_CLASS"]

_STOP = object()
_Handler = Callable[[TransferPlan, Storage, Storage, dict[int, BlockFailure], list], None]

STORAGE_CLASS: dict[TierKind, type[Storage]] = {
    TierKind.DEVICE: MemoryStorage,
    TierKind.HOST: HostStorage,
    TierKind.DISK: DiskStorage,
    TierKind.OBJECT: ObjectStorage,
}
"""The storage class each kind of tier needs; kinds missing here have no backend yet."""


class TransferEngine:
    """Moves blocks between ``storages`` (keyed by tier name; see :data:`STORAGE_CLASS` for
    what each kind of tier needs), for the endpoints of ``worker``. ``copy_engine`` defaults to
    :func:`~kvstrata.physical.copy.default_copy_engine`; ``staging_bytes`` bounds the
    per-worker bounce buffer of the G3->G1 and G4->G1 paths; ``hash_slice_bytes`` is how much of a G1->G2
    batch is copied before its checksums are computed (cache-sized)."""

    def __init__(self, storages: Mapping[str, Storage], *, copy_engine: CopyEngine | None = None,
                 workers_per_path: int = 1, queue_depth: int = 64,
                 staging_bytes: int = 32 << 20, hash_slice_bytes: int = 8 << 20,
                 worker: int = 0, store_nice: int = 0,
                 pacer: ForwardPacer | None = None) -> None:
        self._storages = dict(storages)
        self.store_nice = store_nice
        self.pacer = pacer
        self.worker = worker
        self.hash_slice_bytes = hash_slice_bytes
        self._check_storages()
        first = next(iter(self._storages.values()), None)
        self._block_bytes = first.config.block_bytes if first is not None else 0
        self._owns_copy_engine = copy_engine is None
        self.copy_engine = copy_engine or default_copy_engine()
        self.staging_bytes = staging_bytes
        by_kinds: dict[tuple[TierKind, TierKind], _Handler] = {
            (TierKind.DEVICE, TierKind.HOST): self._device_to_host,
            (TierKind.HOST, TierKind.DEVICE): self._host_to_device,
            (TierKind.HOST, TierKind.DISK): self._host_to_disk,
            (TierKind.DISK, TierKind.HOST): self._disk_to_host,
            (TierKind.DISK, TierKind.DEVICE): self._disk_to_device,
            (TierKind.HOST, TierKind.OBJECT): self._host_to_object,
            (TierKind.DISK, TierKind.OBJECT): self._disk_to_object,
            (TierKind.OBJECT, TierKind.HOST): self._object_to_host,
            (TierKind.OBJECT, TierKind.DEVICE): self._object_to_device}
        tiers = ordered(self._storages)
        self._handlers: dict[str, _Handler] = {
            path_name(a, b): by_kinds[spec(a).kind, spec(b).kind]
            for a in tiers for b in tiers if (spec(a).kind, spec(b).kind) in by_kinds}
        self.paths = tuple(self._handlers)
        # paced path -> whether its plans wait whole (disk) or per round of PUTs (object)
        self._paced_paths = {p: spec(split_path(p)[1]).kind is not TierKind.OBJECT
                             for p in self.paths if _is_background_write(p)}
        self._queues = {p: queue.Queue(maxsize=max(1, queue_depth)) for p in self.paths}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._worker, args=(p,), daemon=True,
                                          name=f"kvstrata-{p}-{i}")
                         for p in self.paths for i in range(max(1, workers_per_path))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ public API
    def submit(self, plan: TransferPlan, timeout: float | None = None) -> "Future[TransferResult]":
        """Queue ``plan``; returns a future resolved with its :class:`TransferResult`.

        Raises :class:`TransferPlanError` (unknown path for these storages, ids out of range),
        :class:`EngineClosedError`, or :class:`EngineBusyError` if the path's queue stayed full
        for ``timeout`` seconds (``None`` waits as long as needed, ``0`` does not wait).
        """
        if not isinstance(plan, TransferPlan):
            raise TransferPlanError(f"expected a TransferPlan, got {type(plan).__name__}")
        if self._closed:
            raise EngineClosedError("transfer engine is closed")
        for endpoint in (plan.source, plan.target):
            if endpoint.worker != self.worker:
                raise TransferPlanError(f"{plan.path}: endpoint {endpoint} is not on worker "
                                        f"{self.worker}, the one this engine serves")
        if plan.path not in self._queues:
            raise TransferPlanError(f"no handler for path {plan.path} in an engine over "
                                    f"{sorted(self._storages)} (paths: {', '.join(self.paths)})")
        for tier, ids in ((plan.src_tier, plan.src_block_ids), (plan.dst_tier, plan.dst_block_ids)):
            if spec(tier).addressing is not Addressing.SLOTS:
                continue              # keys: the storage checks them per block
            limit = self._storages[tier].num_blocks
            if max(ids) >= limit:
                raise TransferPlanError(f"{plan.path}: {tier} block id {max(ids)} out of range "
                                        f"[0, {limit})")
        future: Future[TransferResult] = Future()
        try:
            self._queues[plan.path].put((plan, future), block=timeout != 0,
                                        timeout=timeout or None)
        except queue.Full:
            raise EngineBusyError(f"{plan.path} queue full ({self._queues[plan.path].maxsize} "
                                  f"plans) for {timeout}s") from None
        if self._closed:          # raced with close(): do not leave the future unresolved
            self._cancel_queued()
        return future

    @property
    def copy_kernel(self) -> str:
        """The host copy kernel in use: ``"native"`` (the C extension) or ``"python"`` (its
        pure-Python fallback, e.g. when the extension failed to build); see
        :func:`~kvstrata.physical.copy.native_kernel_status`."""
        return self.copy_engine.kernel

    def storage(self, tier: str) -> Storage:
        """The storage of ``tier``."""
        return self._storages[tier]

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stop the workers after the queued plans ran (or cancel them first). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if cancel_pending:
            self._cancel_queued()
        for p in self.paths:
            for t in self._threads:
                if t.name.startswith(f"kvstrata-{p}-"):
                    self._queues[p].put(_STOP)
        for t in self._threads:
            t.join()
        self._cancel_queued()   # plans that raced with close
        if self._owns_copy_engine:
            self.copy_engine.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ workers
    def _worker(self, path: str) -> None:
        if self.store_nice and not is_onboard(*split_path(path)):
            # a store is background work: on a host whose cores the engine computes on, it
            # yields the CPU (threads it starts, e.g. the copy kernel's, inherit this)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.store_nice)
            except (OSError, AttributeError):
                pass
        q = self._queues[path]
        while True:
            item = q.get()
            if item is _STOP:
                return
            plan, future = item
            del item
            if future.set_running_or_notify_cancel():
                future.set_result(self._execute(plan))
            del plan, future      # an idle worker keeps no result alive

    def _cancel_queued(self) -> None:
        for q in self._queues.values():
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[1].cancel()

    def _execute(self, plan: TransferPlan) -> TransferResult:
        start = time.perf_counter()
        failures: dict[int, BlockFailure] = {}
        checksums: list[int | None] = [None] * len(plan)
        error = None
        whole = self._paced_paths.get(plan.path)
        pacing = self.pacer.plan() if self.pacer is not None and whole is not None else None
        # an object batch paces each round of PUTs (_put_objects reads this); others whole
        self._local.pacing = pacing
        whole_plan = pacing.request() if pacing is not None and whole else nullcontext()
        try:
            with whole_plan:
                self._handlers[plan.path](plan, self._storages[plan.src_tier],
                                          self._storages[plan.dst_tier], failures, checksums)
        except Exception as exc:   # a bug or a dead storage: the whole batch failed
            error = f"{type(exc).__name__}: {exc}"
            ids = plan.dst_block_ids or (-1,) * len(plan)      # keys: no block ids
            for pos, block_id in enumerate(ids):
                failures.setdefault(pos, BlockFailure(pos, block_id, FailureKind.INTERNAL, error))
        finally:
            self._local.pacing = None
        held = pacing.held_seconds if pacing is not None else 0.0
        seconds = max(time.perf_counter() - start - held, 0.0)
        n = len(plan)
        block_bytes = self._block_bytes
        if not failures:   # the common case, without per-block Python work
            return TransferResult(plan=plan, ok=(True,) * n, checksums=tuple(checksums),
                                  bytes_moved=n * block_bytes, seconds=seconds, error=error,
                                  held_seconds=held)
        ok = tuple(pos not in failures for pos in range(n))
        return TransferResult(
            plan=plan, ok=ok,
            checksums=tuple(c if good else None for c, good in zip(checksums, ok)),
            bytes_moved=sum(ok) * block_bytes, seconds=seconds,
            failures=tuple(sorted(failures.values(), key=lambda f: f.position)), error=error,
            held_seconds=held)

    # ------------------------------------------------------------------ path handlers
    def _device_to_host(self, plan, device, host, failures, checksums) -> None:
        host.begin_write(plan.dst_block_ids)
        if not host.eager_checksums:   # deferred: hashed on first need (see HostStorage)
            self.copy_engine.copy(device.memory, plan.src_block_ids, host.memory,
                                  plan.dst_block_ids, direction=OFFLOAD)
            host.seal(plan.dst_block_ids, plan.sequence_hashes, defer=True)
            return
        # The copy engine hashes each block while its bytes are in cache. Where G2 reads are
        # verified, the hash is taken from the engine's own bytes (G1, read in place when it
        # is host memory) just before the copy, so a byte that changes in G2 at any moment
        # after is caught, never stored under a matching checksum; otherwise (and from device
        # memory, which only a device kernel could hash) right behind the copy, from G2.
        from_source = host.verify_reads and device.memory.device.type == "cpu"
        sums = self.copy_engine.copy_hashed(device.memory, plan.src_block_ids,
                                            host.memory, plan.dst_block_ids, direction=OFFLOAD,
                                            slice_bytes=self.hash_slice_bytes,
                                            from_source=from_source)
        checksums[:] = host.seal(plan.dst_block_ids, plan.sequence_hashes, sums)

    def _host_to_device(self, plan, host, device, failures, checksums) -> None:
        good = _check_host_source(host, plan, failures)
        if good:
            self.copy_engine.copy(host.memory, [plan.src_block_ids[p] for p in good],
                                  device.memory, [plan.dst_block_ids[p] for p in good],
                                  direction=ONBOARD)

    def _host_to_disk(self, plan, host, disk, failures, checksums) -> None:
        def write(good, sources, seqs, known):
            identities = {}
            if plan.has_identities:   # a durable disk records them in its index
                identities = {"parent_hashes": [plan.parent_hashes[p] for p in good],
                              "local_hashes": [plan.local_hashes[p] for p in good]}
            return disk.write_blocks([plan.dst_block_ids[p] for p in good], sources, seqs,
                                     checksums=known, **identities)
        self._from_host(plan, host, write, failures, checksums)

    def _from_host(self, plan, host, write, failures, checksums) -> None:
        """Host -> a slower tier (disk, object store): ``write(good, sources, seqs, known)``
        stores the readable host blocks. Known checksums travel end to end: the lower tier
        records the xxh3 the block got when it entered host memory (no second hash pass;
        bytes corrupted there since then fail the lower tier's read). Deferred ones are
        hashed by the lower tier while it writes, and filled in the host's table too."""
        good = _check_host_source(host, plan, failures)
        if not good:
            return
        src_ids = [plan.src_block_ids[p] for p in good]
        seqs = [plan.sequence_hashes[p] for p in good]
        known = host.checksums.checksums_of(src_ids)
        try:
            sums = write(good, [host.block_array(b) for b in src_ids], seqs, known)
        except BlockIOError as exc:
            _remap(exc.failures, good, failures)
            sums = exc.checksums or [None] * len(good)
        if None in known:
            host.checksums.fill(src_ids, sums, seqs)
        for p, value in zip(good, sums):
            checksums[p] = value

    def _disk_to_host(self, plan, disk, host, failures, checksums) -> None:
        host.begin_write(plan.dst_block_ids)
        try:
            disk.read_blocks(plan.src_block_ids,
                             [host.block_array(b) for b in plan.dst_block_ids],
                             plan.sequence_hashes)
        except BlockIOError as exc:
            _remap(exc.failures, range(len(plan)), failures)
        _seal_loaded(plan, host, failures, checksums,
                     lambda p: disk.checksums.get(plan.src_block_ids[p])[0])

    def _disk_to_device(self, plan, disk, device, failures, checksums) -> None:
        self._through_staging(
            plan, disk, failures,
            lambda pos, views: disk.read_blocks([plan.src_block_ids[p] for p in pos], views,
                                                [plan.sequence_hashes[p] for p in pos]),
            lambda memory, pos, good: self._onboard_staged(plan, memory, device, pos, good))

    def _onboard_staged(self, plan, memory, device, positions, good) -> None:
        """Copy the good staged blocks of a round into their device blocks."""
        self.copy_engine.copy(memory, good, device.memory,
                              [plan.dst_block_ids[positions[i]] for i in good],
                              direction=ONBOARD)

    def _through_staging(self, plan, source, failures, read, deliver) -> None:
        """Move ``plan`` round by round through this thread's staging buffer:
        ``read(positions, views)`` fills one view per position (raising ``BlockIOError``
        naming those it could not), ``deliver(memory, positions, good)`` sends on the good
        ones (indices into ``positions``; only verified bytes ever reach it)."""
        staging, memory = self._staging(source)
        per_round = memory.layout.config.num_blocks
        stride = memory.layout.block_stride
        for first in range(0, len(plan), per_round):
            positions = list(range(first, min(first + per_round, len(plan))))
            local_failures: dict[int, BlockFailure] = {}
            try:
                read(positions, [staging.array[i * stride:(i + 1) * stride]
                                 for i in range(len(positions))])
            except BlockIOError as exc:
                _remap(exc.failures, positions, local_failures)
            failures.update(local_failures)
            good = [i for i, p in enumerate(positions) if p not in local_failures]
            if good:
                deliver(memory, positions, good)

    def _host_to_object(self, plan, host, objects, failures, checksums) -> None:
        self._from_host(plan, host, lambda good, sources, seqs, known: self._put_objects(
            objects, [plan.dst_keys[p] for p in good], sources, seqs, known),
            failures, checksums)

    def _put_objects(self, objects, keys, sources, seqs, known) -> list[int]:
        """``objects.put_blocks``; with pacing, one round of ``max_concurrency`` PUTs at a
        time, each round waiting at the gate in this thread (a request thread of the store
        never waits there: the store's pool also serves loads and other batches)."""
        pacing = self._local.pacing
        if pacing is None:
            return objects.put_blocks(keys, sources, seqs, checksums=known)
        step = objects.max_concurrency
        sums: list[int | None] = []
        failed: list[BlockFailure] = []
        for start in range(0, len(keys), step):
            end = start + step
            with pacing.request():
                try:
                    sums.extend(objects.put_blocks(keys[start:end], sources[start:end],
                                                   seqs[start:end],
                                                   checksums=None if known is None
                                                   else known[start:end]))
                except BlockIOError as exc:
                    failed.extend(replace(f, position=f.position + start) for f in exc.failures)
                    sums.extend(exc.checksums or [None] * len(keys[start:end]))
        if failed:
            raise_for_failures(f"put to {objects.status().path}", failed, len(keys), sums)
        return sums  # type: ignore[return-value]

    def _disk_to_object(self, plan, disk, objects, failures, checksums) -> None:
        """G3 -> G4 through the staging buffer: only blocks the disk verified are put, with
        the checksum the disk holds for them (no second hash)."""
        def put(memory, positions, good) -> None:
            stride = memory.layout.block_stride
            staged = memory.regions[0].numpy()
            chosen = [positions[i] for i in good]
            known = [disk.checksums.get(plan.src_block_ids[p])[0] for p in chosen]
            try:
                sums = self._put_objects(objects, [plan.dst_keys[p] for p in chosen],
                                         [staged[i * stride:(i + 1) * stride] for i in good],
                                         [plan.sequence_hashes[p] for p in chosen], known)
            except BlockIOError as exc:
                _remap(exc.failures, chosen, failures)
                sums = exc.checksums or [None] * len(chosen)
            for p, value in zip(chosen, sums):
                checksums[p] = value

        self._through_staging(
            plan, disk, failures,
            lambda pos, views: disk.read_blocks([plan.src_block_ids[p] for p in pos], views,
                                                [plan.sequence_hashes[p] for p in pos]),
            put)

    def _object_to_host(self, plan, objects, host, failures, checksums) -> None:
        host.begin_write(plan.dst_block_ids)
        try:
            verified = objects.get_blocks(plan.src_keys,
                                          [host.block_array(b) for b in plan.dst_block_ids],
                                          plan.sequence_hashes)
        except BlockIOError as exc:
            _remap(exc.failures, range(len(plan)), failures)
            verified = exc.checksums or [None] * len(plan)
        _seal_loaded(plan, host, failures, checksums, lambda p: verified[p])

    def _object_to_device(self, plan, objects, device, failures, checksums) -> None:
        self._through_staging(
            plan, objects, failures,
            lambda pos, views: objects.get_blocks([plan.src_keys[p] for p in pos], views,
                                                  [plan.sequence_hashes[p] for p in pos]),
            lambda memory, pos, good: self._onboard_staged(plan, memory, device, pos, good))

    def _staging(self, storage: Storage) -> tuple[AlignedBuffer, BlockMemory]:
        """This worker thread's aligned bounce buffer for disk/object -> device, as a
        FullyContiguous memory of ``storage``'s geometry."""
        if getattr(self._local, "staging", None) is None:
            config = storage.config
            layout = FullyContiguousLayout(config.with_alignment(
                max(config.alignment, DIRECT_ALIGNMENT)))
            blocks = max(1, self.staging_bytes // layout.block_stride)
            layout = FullyContiguousLayout(layout.config.with_blocks(blocks))
            buffer = AlignedBuffer(layout.region_bytes(0))
            self._local.staging = (buffer, BlockMemory(layout, (buffer.tensor,)))
        return self._local.staging

    # ------------------------------------------------------------------ validation
    def _check_storages(self) -> None:
        for tier, storage in self._storages.items():
            try:
                kind = spec(tier).kind
            except UnknownTierError as exc:
                raise StorageConfigError(str(exc)) from None
            expected = STORAGE_CLASS.get(kind)
            if expected is None:
                raise StorageConfigError(f"{tier} ({kind.value}): no storage backend for this "
                                         f"kind of tier yet")
            if not isinstance(storage, expected):
                raise StorageConfigError(f"{tier} ({kind.value}) must be a {expected.__name__}, "
                                         f"got {type(storage).__name__}")
        layouts = [s.layout for s in self._storages.values()]
        for layout in layouts[1:]:
            layouts[0].require_compatible(layout)


def _is_background_write(path: str) -> bool:
    """Whether ``path`` writes away from the engine without reading the engine's own memory
    (the writes a :class:`~kvstrata.physical.pacing.ForwardPacer` holds back)."""
    source, target = split_path(path)
    return not is_onboard(source, target) and spec(source).kind is not TierKind.DEVICE


def _check_host_source(host: HostStorage, plan: TransferPlan,
                       failures: dict[int, BlockFailure]) -> list[int]:
    """Record the blocks of ``host`` that fail their read check; the positions still good."""
    for f in host.check_readable(plan.src_block_ids, plan.sequence_hashes):
        failures[f.position] = f
    return [p for p in range(len(plan)) if p not in failures]


def _seal_loaded(plan: TransferPlan, host: HostStorage, failures: dict[int, BlockFailure],
                 checksums: list, verified_checksum) -> None:
    """Seal the host slots a load into G2 filled (every position not in ``failures``) with
    the checksum the source verified (``verified_checksum(position)``)."""
    good = [p for p in range(len(plan)) if p not in failures]
    sums = host.seal([plan.dst_block_ids[p] for p in good],
                     [plan.sequence_hashes[p] for p in good],
                     [verified_checksum(p) for p in good])
    for p, value in zip(good, sums):
        checksums[p] = value


def _remap(sub_failures, positions, failures: dict[int, BlockFailure]) -> None:
    """Record failures of a sub-batch (positions relative to it) at their plan positions."""
    positions = list(positions)
    for f in sub_failures:
        pos = positions[f.position]
        failures[pos] = BlockFailure(pos, f.block_id, f.kind, f.detail)
