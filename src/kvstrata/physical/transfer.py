"""The transfer engine: executes :class:`TransferPlan` batches between tier storages.

(Nearly 700 lines on purpose: one concern, running plans; the queues, the workers and the
five ways a plan moves its bytes share the engine's staging buffers and pacing.)

Usage::

    engine = TransferEngine({"G1": device, "G2": host, "G3": disk, "G4": objects})
    future = engine.submit(TransferPlan(job_id, Endpoint("G1"), Endpoint("G2"), seq_hashes,
                                        src_block_ids=src_ids, dst_block_ids=dst_ids))
    result = future.result()
    engine.close()

* Storages are keyed by tier name; each must serve its tier's kind (``storage.kind``, see
  :mod:`kvstrata.tiers`). The paths are *derived* from what the two storages of a pair are
  (:mod:`.storage.base`), never listed per kind: memory to memory is one copy engine call
  (device <-> host RAM); a :class:`~.storage.base.BlockStore` (disk, object store) is read
  into and written from a memory whose blocks are host arrays in place, and reaches any
  other memory, or another block store, through this worker's staging buffer. Blocks are
  onboarded into memory and stored down into block stores, so a store is never written from
  device memory directly (that goes through host RAM, as two plans) and never onboarded
  into. A storage of a new kind of tier gets its paths by being one of the two kinds of
  storage. The engine serves the endpoints of its own worker. Slot-addressed tiers are named
  by block ids in plans, key-addressed ones (G4) by keys (``src_keys``/``dst_keys``).
* One bounded queue and ``workers_per_path`` worker threads per path, so offload and onboard
  never wait behind each other; at most ``queue_depth + workers_per_path`` plans per path are
  in flight. :meth:`TransferEngine.submit` waits (sleeping) for room up to ``timeout`` and then
  raises :class:`EngineBusyError`. With ``store_nice``, the threads of paths away from the
  engine (stores) run at that CPU niceness: background work that yields to the engine's
  compute where the engine uses every core. With a ``pacer``
  (:class:`~kvstrata.physical.pacing.ForwardPacer`), the writes into a block store also wait
  while the engine's forward runs: a plan before it starts, or, for a store that writes in
  rounds (``write_round``: an object store's concurrent PUTs), each round. The time a plan was
  held back is reported apart (``TransferResult.held_seconds``), not in ``seconds``.
* Each plan is one batched call per storage pair: a copy engine call between memory layouts
  (:mod:`~kvstrata.physical.copy`), coalesced ``preadv``/``pwritev`` for disk, concurrent
  requests for the object store.
* Every plan completes with a :class:`TransferResult` set on the returned
  ``concurrent.futures.Future``: the future is the only channel a result travels by (an
  owner that wants results on its own thread attaches a callback that posts them there, as
  :class:`~kvstrata.placement.EngineExecutor` does), so the engine keeps no result once its
  future is dropped. Failed blocks are reported per block, never raised through the future,
  so the owner handles every outcome in one place.
* Integrity: blocks written into a storage that keeps checksums (G2) or into a block store
  are checksummed (xxh3-64) and their slot records the sequence hash only after the write
  succeeded; G4 objects carry the checksum and sequence hash in their header. Reads from
  block stores always verify, reads from G2 check the sequence hash and verify bytes when
  the host storage has ``verify_reads``. A block that fails is reported in
  ``failures``/``failed_sequence_hashes`` and its bytes are not used.
* With a G1 on a GPU, the bounce buffer is registered with CUDA, so a G3/G4 -> G1 round goes
  from the buffer into the engine's KV tensors by the device copy kernel (one launch).
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
from typing import Callable, Mapping, Sequence

import numpy as np

from ..protocol.layout import FullyContiguousLayout
from ..protocol.plans import TransferPlan
from ..protocol.results import TransferResult
from ..tiers import Addressing, UnknownTierError, is_onboard, ordered, path_name, spec, split_path
from .buffers import AlignedBuffer, pinned_if_possible
from .copy import OFFLOAD, ONBOARD, CopyEngine
from .engines import default_copy_engine
from .errors import (BlockFailure, BlockIOError, EngineBusyError, EngineClosedError,
                     FailureKind, StorageConfigError, TransferPlanError, raise_for_failures)
from .pacing import ForwardPacer
from .storage.base import BlockMemory, BlockStore, MemoryStorage, Storage
from .storage.disk import DIRECT_ALIGNMENT

__all__ = ["TransferEngine"]

_STOP = object()
_Handler = Callable[[TransferPlan, Storage, Storage, dict[int, BlockFailure], list], None]


class TransferEngine:
    """Moves blocks between ``storages`` (keyed by tier name, each serving its tier's kind),
    for the endpoints of ``worker``. ``copy_engine`` defaults to
    :func:`~kvstrata.physical.engines.default_copy_engine`; ``staging_bytes`` bounds the
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
        self._pin_staging = any(isinstance(s, MemoryStorage) and s.memory.device.type == "cuda"
                                for s in self._storages.values())
        tiers = ordered(self._storages)
        self._handlers: dict[str, _Handler] = {}
        for a in tiers:
            for b in tiers:
                handler = self._route(a, b) if a != b else None
                if handler is not None:
                    self._handlers[path_name(a, b)] = handler
        self.paths = tuple(self._handlers)
        # a path into a block store is paced: path -> whether its plans wait whole (True) or
        # per round of the store's writes (False)
        self._paced_paths = {p: self._storages[split_path(p)[1]].write_round is None
                             for p, h in self._handlers.items()
                             if h in (self._store_in_place, self._store_staged,
                                      self._store_from_memory)}
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
        # a store that writes in rounds paces each round (_write reads this); others whole
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
            source = self._storages.get(plan.src_tier)
            if isinstance(source, MemoryStorage):
                source.forget_reads()
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

    # ------------------------------------------------------------------ paths
    def _route(self, source_tier: str, target_tier: str) -> _Handler | None:
        """How a plan from ``source_tier`` to ``target_tier`` moves its bytes, from what the
        two storages are (see the module docstring); None where no block moves that way."""
        src, dst = self._storages[source_tier], self._storages[target_tier]
        if isinstance(src, MemoryStorage) and isinstance(dst, MemoryStorage):
            return self._copy_memory
        if isinstance(src, BlockStore) and isinstance(dst, MemoryStorage):
            return self._load_in_place if dst.host_arrays else self._load_staged
        if isinstance(dst, BlockStore) and not is_onboard(source_tier, target_tier):
            if isinstance(src, MemoryStorage) and src.host_arrays:
                return self._store_in_place
            if isinstance(src, MemoryStorage) and not any(
                    isinstance(s, MemoryStorage) and s.host_arrays
                    for s in self._storages.values()):
                return self._store_from_memory     # no host tier to stage in: ours
            if isinstance(src, BlockStore):
                return self._store_staged
        return None

    def _copy_memory(self, plan, src, dst, failures, checksums) -> None:
        """Memory to memory in one copy engine call (device <-> host RAM). A target that
        keeps checksums is sealed with them: hashed by the copy engine while each block's
        bytes are in cache, or, with deferred checksums, on first need."""
        direction = ONBOARD if is_onboard(plan.src_tier, plan.dst_tier) else OFFLOAD
        ids = _PlanIds(plan)
        summable = getattr(self.copy_engine, "summable", None)
        if summable is not None and summable(src.memory, dst.memory):
            if dst.keeps_checksums and dst.verify_reads:
                self._offload_summed(ids, src, dst, failures, checksums, direction)
                return
            if src.keeps_checksums and src.verify_reads and not dst.keeps_checksums:
                self._onboard_summed(ids, src, dst, failures, direction)
                return
        if not dst.keeps_checksums or not dst.eager_checksums:
            # the source's read check (bytes verified, for a verifying G2) slice by slice,
            # each slice checked while the copy engine may still be copying the one before
            def check(lo: int, hi: int) -> list[int]:
                passed = _readable(src, ids, failures, range(lo, hi))
                if passed:          # only the slots about to be written are invalidated
                    dst.begin_write(ids.dst[passed])
                return passed

            good = self.copy_engine.copy_checked(
                src.memory, ids.src, dst.memory, ids.dst, check,
                direction=direction, slice_bytes=self.hash_slice_bytes)
            good = _confirmed(src, ids, failures, good)
            if dst.keeps_checksums and good:   # deferred: hashed on first need (HostStorage)
                kept = ids.at(good)
                dst.seal(kept.dst, kept.seqs, defer=True)
            return
        good = _readable(src, ids, failures)
        if not good:
            return
        kept = ids.at(good)
        dst.begin_write(kept.dst)
        # Where the target's reads are verified, the hash is taken from the source's own
        # bytes (read in place when it is host memory) just before the copy, so a byte that
        # changes in the target at any moment after is caught, never stored under a matching
        # checksum; otherwise (and from device memory, which only a device kernel could
        # hash) right behind the copy, from the target.
        from_source = dst.verify_reads and src.memory.device.type == "cpu"
        sums = self.copy_engine.copy_hashed(src.memory, kept.src, dst.memory, kept.dst,
                                            direction=direction,
                                            slice_bytes=self.hash_slice_bytes,
                                            from_source=from_source)
        sealed = dst.seal(kept.dst, kept.seqs, sums)
        for p, value in zip(good, sealed):
            checksums[p] = value

    def _offload_summed(self, ids, src, dst, failures, checksums, direction) -> None:
        """Into a verifying G2 through the GPU copy kernel: each block's device checksum is
        computed by the kernel from the engine's own bytes as they pass and recorded with
        the slot (its xxh3 is left to the first need: a store to G3 hashes it, after checking
        the device checksum). Each slice is sealed as soon as it landed, while the next ones
        copy (a G2 shared with other ranks hashes its seals on the host: that overlaps the
        copy too). A slice sealed before a later one failed keeps its seal, which is true:
        the slot holds that block, checked; the plan is reported failed whole, and the slot
        is invalidated when it is next written."""
        good = _readable(src, ids, failures)
        if not good:
            return
        kept = ids.at(good)
        dst.begin_write(kept.dst)     # whole, first: a slot another process reads fails it all

        def seal(lo: int, hi: int, sums: np.ndarray) -> None:
            dst.seal(kept.dst[lo:hi], kept.seqs[lo:hi], defer=True, device_sums=sums)

        sums = self.copy_engine.copy_summed(src.memory, kept.src, dst.memory, kept.dst,
                                            direction=direction, landed=seal)
        if sums is None:      # the engine could not after all: xxh3 behind the copy instead
            hashed = self.copy_engine.copy_hashed(src.memory, kept.src, dst.memory, kept.dst,
                                                  direction=direction,
                                                  slice_bytes=self.hash_slice_bytes)
            for p, value in zip(good, dst.seal(kept.dst, kept.seqs, hashed)):
                checksums[p] = value

    def _onboard_summed(self, ids, src, dst, failures, direction) -> None:
        """From a verifying G2 into device memory through the GPU copy kernel. Blocks whose
        slot has a device checksum are copied with the checksum kernel and each compared
        with the recorded one, so the bytes checked are the bytes that arrived; a block that
        differs was written into its device slot but is reported failed (the engine
        recomputes it, never reads it as loaded). Other blocks are verified on the host
        before they are copied (xxh3, slice by slice)."""
        readable = np.ones(len(ids), dtype=bool)
        for f in src.check_readable(ids.src, ids.seqs, verify=False):
            failures[f.position] = f
            readable[f.position] = False
        good = np.flatnonzero(readable)
        if not good.size:
            return
        dst.begin_write(ids.dst)
        expected, known = src.device_sums_for_read(ids.src[good], ids.seqs[good])
        summed = good[known]
        if summed.size:
            sums = self.copy_engine.copy_summed(src.memory, ids.src[summed], dst.memory,
                                                ids.dst[summed], direction=direction)
            if sums is None:    # nothing copied: verified on the host with the rest below
                src.confirm_read(ids.src[summed], ids.seqs[summed])   # (a reader's snapshot)
                known[:] = False
            else:
                recorded = expected[known]
                for i in np.flatnonzero(sums != recorded).tolist():
                    p = int(summed[i])
                    failures[p] = BlockFailure(
                        p, int(ids.src[p]), FailureKind.CHECKSUM_MISMATCH,
                        f"device checksum {int(sums[i]):#018x} != recorded "
                        f"{int(recorded[i]):#018x}")
                # a slot another process rewrote while it was copied out fails too
                _confirmed(src, ids, failures, summed.tolist())
        rest = good[~known].tolist()
        if rest:
            def check(lo: int, hi: int) -> list[int]:   # batch indices into rest
                passed = set(_readable(src, ids, failures, rest[lo:hi]))
                return [j for j in range(lo, hi) if rest[j] in passed]

            copied = self.copy_engine.copy_checked(
                src.memory, ids.src[rest], dst.memory, ids.dst[rest], check,
                direction=direction, slice_bytes=self.hash_slice_bytes)
            _confirmed(src, ids, failures, [rest[j] for j in copied])

    def _load_in_place(self, plan, store, dst, failures, checksums) -> None:
        """A block store read straight into a memory's host arrays, then sealed with the
        checksums the store verified."""
        dst.begin_write(plan.dst_block_ids)
        try:
            verified = store.read_blocks(plan.src_addresses,
                                         [dst.block_array(b) for b in plan.dst_block_ids],
                                         plan.sequence_hashes)
        except BlockIOError as exc:
            _remap(exc.failures, range(len(plan)), failures)
            verified = exc.checksums or [None] * len(plan)
        good = [p for p in range(len(plan)) if p not in failures]
        sealed = dst.seal([plan.dst_block_ids[p] for p in good],
                          [plan.sequence_hashes[p] for p in good],
                          [verified[p] for p in good])
        for p, value in zip(good, sealed):
            checksums[p] = value

    def _load_staged(self, plan, store, dst, failures, checksums) -> None:
        """A block store read into the staging buffer, round by round; each round's verified
        blocks copied into the memory (device memory, whose blocks are not host arrays)."""
        def deliver(memory, positions, good, verified) -> None:
            self.copy_engine.copy(memory, good, dst.memory,
                                  [plan.dst_block_ids[positions[i]] for i in good],
                                  direction=ONBOARD)

        dst.begin_write(plan.dst_block_ids)
        self._through_staging(plan, store, failures, deliver)

    def _store_in_place(self, plan, src, store, failures, checksums) -> None:
        """A memory's host arrays written straight into a block store. Known checksums
        travel end to end: the store records the xxh3 the block got when it entered the
        memory (no second hash pass; bytes corrupted there since then fail the store's
        read). Deferred ones are hashed by the store while it writes, and filled in the
        memory's table too."""
        if _written_elsewhere(src, plan, failures):
            return
        good = _readable(src, _PlanIds(plan), failures)
        if not good:
            return
        src_ids = [plan.src_block_ids[p] for p in good]
        seqs = [plan.sequence_hashes[p] for p in good]
        known = src.checksums.checksums_of(src_ids) if src.keeps_checksums else None
        try:
            sums = self._write(plan, store, good, [src.block_array(b) for b in src_ids], known)
        except BlockIOError as exc:
            _remap(exc.failures, good, failures)
            sums = exc.checksums or [None] * len(good)
        if known is not None and None in known:
            src.checksums.fill(src_ids, sums, seqs)
        for p, value in zip(good, sums):
            checksums[p] = value

    def _store_from_memory(self, plan, src, store, failures, checksums) -> None:
        """A memory whose blocks are not host arrays (an engine's KV tensors, with no host
        tier in between: SGLang's host pool over a G3) written to a block store through the
        staging buffer, round by round: the round's blocks copied in, then written (the
        store hashes them as it writes)."""
        if _written_elsewhere(src, plan, failures):
            return
        good = _readable(src, _PlanIds(plan), failures)
        if not good:
            return
        _, memory = self._staging(store)
        per_round = memory.layout.config.num_blocks
        stride = memory.layout.block_stride
        staged = memory.regions[0].numpy()
        for first in range(0, len(good), per_round):
            chosen = good[first:first + per_round]
            self.copy_engine.copy(src.memory, [plan.src_block_ids[p] for p in chosen], memory,
                                  list(range(len(chosen))), direction=OFFLOAD)
            try:
                sums = self._write(plan, store, chosen,
                                   [staged[i * stride:(i + 1) * stride]
                                    for i in range(len(chosen))], None)
            except BlockIOError as exc:
                _remap(exc.failures, chosen, failures)
                sums = exc.checksums or [None] * len(chosen)
            for p, value in zip(chosen, sums):
                checksums[p] = value

    def _store_staged(self, plan, src, store, failures, checksums) -> None:
        """One block store into another through the staging buffer (G3 -> G4): only blocks
        the source verified are written, with the checksums it verified (no second hash)."""
        def deliver(memory, positions, good, verified) -> None:
            stride = memory.layout.block_stride
            staged = memory.regions[0].numpy()
            chosen = [positions[i] for i in good]
            try:
                sums = self._write(plan, store, chosen,
                                   [staged[i * stride:(i + 1) * stride] for i in good],
                                   [verified[i] for i in good])
            except BlockIOError as exc:
                _remap(exc.failures, chosen, failures)
                sums = exc.checksums or [None] * len(chosen)
            for p, value in zip(chosen, sums):
                checksums[p] = value

        self._through_staging(plan, src, failures, deliver)

    def _write(self, plan: TransferPlan, store: BlockStore, positions: Sequence[int],
               sources: list, known: list | None) -> list[int]:
        """``store.write_blocks`` of the plan's blocks at ``positions`` from ``sources``. With
        pacing and a store that writes in rounds, one round of ``write_round`` blocks at a
        time, each waiting at the gate in this thread (a request thread of the store never
        waits there: the store's pool also serves loads and other batches)."""
        addresses = [plan.dst_addresses[p] for p in positions]
        seqs = [plan.sequence_hashes[p] for p in positions]
        parents = [plan.parent_hashes[p] for p in positions] if plan.has_identities else None
        locals_ = [plan.local_hashes[p] for p in positions] if plan.has_identities else None
        pacing = self._local.pacing
        step = store.write_round
        if pacing is None or step is None:
            return store.write_blocks(addresses, sources, seqs, checksums=known,
                                      parent_hashes=parents, local_hashes=locals_)
        sums: list[int | None] = []
        failed: list[BlockFailure] = []
        for start in range(0, len(addresses), step):
            end = start + step
            with pacing.request():
                try:
                    sums.extend(store.write_blocks(
                        addresses[start:end], sources[start:end], seqs[start:end],
                        checksums=None if known is None else known[start:end],
                        parent_hashes=None if parents is None else parents[start:end],
                        local_hashes=None if locals_ is None else locals_[start:end]))
                except BlockIOError as exc:
                    failed.extend(replace(f, position=f.position + start) for f in exc.failures)
                    sums.extend(exc.checksums or [None] * len(addresses[start:end]))
        if failed:
            raise_for_failures(f"write to {store.status().path}", failed, len(addresses), sums)
        return sums  # type: ignore[return-value]

    def _through_staging(self, plan, store, failures, deliver) -> None:
        """Move ``plan`` round by round through this thread's staging buffer: each round's
        blocks are read from ``store`` (verified), then ``deliver(memory, positions, good,
        verified)`` sends on the good ones (``good``: indices into ``positions``; only
        verified bytes ever reach it; ``verified``: the round's checksums)."""
        staging, memory = self._staging(store)
        per_round = memory.layout.config.num_blocks
        stride = memory.layout.block_stride
        for first in range(0, len(plan), per_round):
            positions = list(range(first, min(first + per_round, len(plan))))
            local_failures: dict[int, BlockFailure] = {}
            try:
                verified = store.read_blocks(
                    [plan.src_addresses[p] for p in positions],
                    [staging.array[i * stride:(i + 1) * stride] for i in range(len(positions))],
                    [plan.sequence_hashes[p] for p in positions])
            except BlockIOError as exc:
                _remap(exc.failures, positions, local_failures)
                verified = exc.checksums or [None] * len(positions)
            failures.update(local_failures)
            good = [i for i, p in enumerate(positions) if p not in local_failures]
            if good:
                deliver(memory, positions, good, verified)

    def _staging(self, storage: Storage) -> tuple[AlignedBuffer, BlockMemory]:
        """This worker thread's aligned bounce buffer for disk/object -> device, as a
        FullyContiguous memory of ``storage``'s geometry."""
        if getattr(self._local, "staging", None) is None:
            config = storage.config
            layout = FullyContiguousLayout(config.with_alignment(
                max(config.alignment, DIRECT_ALIGNMENT)))
            blocks = max(1, self.staging_bytes // layout.block_stride)
            layout = FullyContiguousLayout(layout.config.with_blocks(blocks))
            # registered with CUDA where a G1 is on a GPU: the device copy kernel reads it
            size = layout.region_bytes(0)
            buffer = pinned_if_possible(size) if self._pin_staging else AlignedBuffer(size)
            self._local.staging = (buffer, BlockMemory(layout, (buffer.tensor,)))
        return self._local.staging

    # ------------------------------------------------------------------ validation
    def _check_storages(self) -> None:
        for tier, storage in self._storages.items():
            try:
                kind = spec(tier).kind
            except UnknownTierError as exc:
                raise StorageConfigError(str(exc)) from None
            if storage.kind != kind.value:
                raise StorageConfigError(f"{tier} ({kind.value}) needs a storage of its kind, "
                                         f"got {type(storage).__name__} ({storage.kind})")
            if not isinstance(storage, (MemoryStorage, BlockStore)):
                raise StorageConfigError(f"{tier}: {type(storage).__name__} is neither a "
                                         f"MemoryStorage nor a BlockStore")
        layouts = [s.layout for s in self._storages.values()]
        for layout in layouts[1:]:
            layouts[0].require_compatible(layout)


class _PlanIds:
    """A plan's source and target slot ids (``int64``) and sequence hashes (``uint64``) as
    numpy arrays, converted once: the storages' checks, invalidations and seals are
    vectorized, and each call would otherwise convert the plan's tuples again (about 0.1 ms
    per 4,096 ints; a GPU plan's host work before and after its copy is not overlapped).
    A side addressed by keys has no ids (an empty array)."""

    __slots__ = ("src", "dst", "seqs")

    def __init__(self, plan: TransferPlan | None) -> None:
        if plan is not None:
            self.src = np.asarray(plan.src_block_ids, dtype=np.int64)
            self.dst = np.asarray(plan.dst_block_ids, dtype=np.int64)
            self.seqs = np.asarray(plan.sequence_hashes, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.seqs)

    def at(self, positions: Sequence[int]) -> "_PlanIds":
        """The ids of the blocks at plan ``positions``, distinct and ascending as every
        caller's are (slices of the plan, and those of them that passed): itself when they
        are as many as the plan's blocks, which makes them all."""
        if len(positions) == len(self.seqs):
            return self
        at = np.asarray(positions, dtype=np.int64)
        part = _PlanIds(None)
        part.src = self.src[at] if self.src.size else self.src
        part.dst = self.dst[at] if self.dst.size else self.dst
        part.seqs = self.seqs[at]
        return part


def _readable(source: Storage, ids: _PlanIds, failures: dict[int, BlockFailure],
              positions: Sequence[int] | None = None) -> list[int]:
    """Record the blocks at plan ``positions`` (default: all) of a memory ``source`` that
    fail its read check; those of ``positions`` still good."""
    if positions is None:
        positions = range(len(ids))
    part = ids.at(positions)
    for f in source.check_readable(part.src, part.seqs):
        p = positions[f.position]
        failures[p] = f if p == f.position else replace(f, position=p)
    if not failures:
        return list(positions)
    return [p for p in positions if p not in failures]


def _written_elsewhere(source: MemoryStorage, plan: TransferPlan,
                       failures: dict[int, BlockFailure]) -> bool:
    """Whether ``source`` is written by another process, which stores what it holds: then
    every block of this store fails, none is stored from here."""
    if not source.written_elsewhere:
        return False
    for p, block in enumerate(plan.src_block_ids):
        failures[p] = BlockFailure(p, block, FailureKind.INTERNAL,
                                   "not stored from a tier another process writes (it "
                                   "stores it)")
    return True


def _confirmed(source: Storage, ids: _PlanIds, failures: dict[int, BlockFailure],
               positions: list[int]) -> list[int]:
    """Of the plan ``positions`` just copied out of a memory ``source``, those its
    :meth:`~.storage.base.MemoryStorage.confirm_read` still vouches for (the others are
    recorded as failed: rewritten by another process while they were read)."""
    if not positions:
        return positions
    part = ids.at(positions)
    found = source.confirm_read(part.src, part.seqs)
    for f in found:
        p = positions[f.position]
        failures[p] = replace(f, position=p)
    bad = {positions[f.position] for f in found}
    return [p for p in positions if p not in bad] if bad else positions


def _remap(sub_failures, positions, failures: dict[int, BlockFailure]) -> None:
    """Record failures of a sub-batch (positions relative to it) at their plan positions."""
    positions = list(positions)
    for f in sub_failures:
        pos = positions[f.position]
        failures[pos] = BlockFailure(pos, f.block_id, f.kind, f.detail)
