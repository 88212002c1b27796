"""The connector's worker half: kvstrata's G2 / G3 bytes in each vLLM worker process.

It wraps vLLM's KV tensors as G1 without copying (:func:`wrap_vllm_kv_caches`), owns the
host (G2) and disk (G3) storages and a :class:`~kvstrata.physical.TransferEngine` over them,
and runs the plans the scheduler half ships each step (:class:`StepOrders`):

* plans that do not read vLLM's KV (loads into G1, the cascade G2 -> G3) start as soon as the
  orders arrive; a request's load is reported finished (``get_finished``) when every plan
  filling it completed, and its blocks that failed (or could not be planned) are reported by
  ``get_block_ids_with_load_errors`` in the same step, so vLLM recomputes them;
* plans reading vLLM's KV (the stores G1 -> G2) start in ``wait_for_save``, after the step's
  forward wrote the KV; vLLM does not reuse those blocks until the scheduler half says the
  copies are done (it holds finished requests; see ``request_finished``), and when requests
  were preempted ``handle_preemptions`` waits for every copy reading vLLM's KV before the
  forward can overwrite freed blocks;
* on a CPU engine (``yield_to_forward``) the writes to G3/G4 wait while a forward runs
  (:class:`~kvstrata.physical.pacing.ForwardPacer`; the forward is the span between
  :meth:`WorkerHalf.start` and :meth:`WorkerHalf.save`): they take no core from it;
* every finished plan's :class:`~kvstrata.protocol.TransferResult` goes back to the scheduler
  in the step's :class:`WorkerReport`.

An MLA model over tensor-parallel ranks holds the same latent on every rank of a group
(:attr:`~.settings.KvGeometry.replicas`): its first rank writes G2/G3/G4 for the group; the
others build their G3 as the first rank's, followed read-only
(:attr:`~kvstrata.kinds.StorageOptions.follow_durable`), and their G2 as the first rank's,
mapped read-only from shared memory (:attr:`~kvstrata.kinds.StorageOptions.shared_host`,
where :attr:`~.settings.ConnectorSettings.shared_host_dir` says so; else a G2 of their
own), report plans into those tiers done without running them, and load from that one
copy.

On a GPU build the only difference is the copy engine (the device copy kernel between the KV
tensors and G2 registered with CUDA, on its own CUDA streams): this module is the same. Without a GPU the G1 "device" is vLLM's CPU KV
cache, which is what vLLM's CPU build runs on.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import replace
from typing import Callable, Mapping

import torch

from ...kinds import StorageOptions, Storages, build_storages, kind_of
from ...kinds.base import TierSetupError
from ...physical import DeviceStorage, TransferEngine
from ...physical.copy import CopyEngine
from ...physical.errors import LayoutError
from ...physical.leftovers import owner_tag
from ...physical.storage.host_shared import SharedHost
from ...physical.pacing import ForwardPacer
from ...placement import EngineExecutor
from ...protocol.plans import TransferPlan
from ...protocol.results import FailureKind, TransferResult
from ...tiers import TOP_TIER, TierKind, spec
from .metadata import StepOrders, WorkerReport
from .settings import ConnectorSettings
from .sharing import HOST, G2Export, RemoteLoader

__all__ = ["WorkerHalf", "wrap_vllm_kv_caches"]

log = logging.getLogger(__name__)

FLUSH_TIMEOUT = 300.0
"""Seconds ``handle_preemptions`` / ``shutdown`` wait for copies before giving up on them."""
WRITER_WAIT = 600.0
"""Seconds a worker that reads another's G3 waits at start for that worker to make it."""
TAKEOVER_WAIT = 60.0
"""Seconds such a worker retries building once that G3 exists (its writer restarting)."""
_PERSISTENT = (TierKind.DISK, TierKind.OBJECT)


def wrap_vllm_kv_caches(kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                        block_size: int) -> DeviceStorage:
    """vLLM's per-layer KV tensors as kvstrata's G1, without copying.

    Layers that alias another layer's memory are kept once: KV sharing, and the layers of
    different KV cache groups, which overlay each other (a block id belongs to one group at
    a time). Of the views of one memory, a dense one is kept (an attention layer's, not a
    Mamba state's, which covers only the start of each padded page). The layout is read
    from the shape: a leading ``2`` before ``num_blocks`` is K/V-major (FlashAttention:
    ``[2, blocks, ...]``); a leading ``num_blocks`` whose block is one dense page per layer
    (vLLM's CPU backend ``[blocks, heads, block_size, 2*head]``, FlashInfer ``[blocks, 2,
    ...]``, MLA ``[blocks, 1, block_size, latent]``) is moved as one opaque page per block
    and layer."""
    views: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        kept = views.get(tensor.data_ptr())
        if kept is None or (not _dense_pages(kept[1]) and _dense_pages(tensor)):
            views[tensor.data_ptr()] = (name, tensor)
    if not views:
        raise LayoutError("vLLM registered no KV cache tensor")
    layers = dict(views.values())
    first = next(iter(layers.values()))
    shape = tuple(first.shape)
    if len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks:
        return DeviceStorage.wrap(layers, kv_layout="outer_contiguous", page_size=block_size)
    if shape and shape[0] == num_blocks:
        return DeviceStorage.wrap(layers, kv_layout="block_page", page_size=block_size)
    raise LayoutError(f"vLLM KV cache of shape {shape} has no dimension of {num_blocks} "
                      f"blocks first or second: layout not supported")


def _dense_pages(tensor: torch.Tensor) -> bool:
    """Whether a block's page of ``tensor`` (dimension 0 the block) is all of its stride."""
    return tensor.dim() >= 2 and tensor.stride(0) == tensor[0].numel()


class WorkerHalf:
    """See the module docstring. ``rank`` is this worker's tensor-parallel rank;
    ``copy_engine`` overrides the transfer engine's default (the GPU data path's
    :class:`~kvstrata.physical.device_copy.DeviceCopyEngine` when CUDA is present, the host
    memmove engine otherwise)."""

    def __init__(self, settings: ConnectorSettings, rank: int = 0,
                 copy_engine: CopyEngine | None = None, world_size: int = 1,
                 server: str | None = None) -> None:
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.server = server or owner_tag(os.getppid())
        """A name of this engine unique among the host's live engines, with an owner tag
        (names a G2 its workers share)."""
        self._recovered: dict[str, list[tuple[int, int, int | None, int]]] | None = None
        self._copy_engine = copy_engine
        self.storages: Storages | None = None
        self.engine: TransferEngine | None = None
        self._executor: EngineExecutor | None = None
        self._done: queue.SimpleQueue[tuple[float, TransferResult]] = queue.SimpleQueue()
        """Finished copies, with when each finished (``time.monotonic``)."""
        self._reported: list[tuple[int, TransferResult]] = []
        self._outstanding: set[int] = set()
        self._reading_g1: set[int] = set()
        self._overwritten: set[int] = set()
        """Copies out of G1 that a flush gave up waiting for: the forward overwrote what
        they read, so they fail whatever they copied."""
        self._stores: list[TransferPlan] = []
        self._bound_at = 0.0
        """When the step's orders came (``time.monotonic``): its stores wait from then for
        the forward to write what they read."""
        self._waited: dict[int, float] = {}
        """Per store plan (job id), the seconds it waited for the step's forward."""
        self._job_request: dict[int, str] = {}
        self._request_jobs: dict[str, set[int]] = {}
        self._request_failed: dict[str, set[int]] = {}
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()
        self._timing: tuple[int, float] | None = None
        self._forwards: list[tuple[int, float]] = []
        self._export: G2Export | None = None
        self._remote: RemoteLoader | None = None
        self.pacer: ForwardPacer | None = None
        self._written_elsewhere: set[str] = set()
        """Persistent tiers another worker writes for this one (it holds the same bytes):
        plans into them are done there, and reported done here without running."""

    # -- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        kv = self.settings.kv
        g1 = wrap_vllm_kv_caches(kv_caches, kv.tier_blocks(TOP_TIER), kv.block_size)
        if g1.config.num_layers != kv.model.num_layers:
            raise LayoutError(f"vLLM's KV cache has {g1.config.num_layers} distinct pages per "
                              f"block here, its KV cache config says "
                              f"{kv.model.num_layers}: layout not supported")
        identity = self.settings.stored_as(self.rank, self.world_size)
        options = StorageOptions(g1=g1, verify_host_reads=self.settings.verify_host_reads,
                                 o_direct=self.settings.o_direct, rank=identity.rank,
                                 world_size=identity.world_size,
                                 block_layout=self.settings.block_layout,
                                 follow_durable=not identity.writer,
                                 shared_host=self._shared_host(identity))
        try:
            self.storages = self._build(kv, options)
        except BaseException:
            g1.close()
            raise
        try:
            self._start(identity, options, g1)
        except BaseException:          # (an export's port taken): nothing kept until exit
            self._stop_copies()
            self._executor = None
            self.storages.close()
            self.storages = None
            raise

    def _start(self, identity, options: StorageOptions, g1) -> None:
        """What runs on the storages: the transfer engine, the export and the peers."""
        if not identity.writer:
            # the writer of this identity stores them; this worker reads its copy
            written_there = _PERSISTENT + ((TierKind.HOST,) if options.shared_host else ())
            self._written_elsewhere = {t for t in self.storages.by_tier
                                       if spec(t).kind in written_there}
        self._recovered = self.storages.recovered_rows()
        pace = self.settings.yield_to_forward
        if pace is None:              # auto: where the forward computes on the host's cores
            pace = getattr(getattr(g1, "device", None), "type", "cpu") == "cpu"
        self.pacer = ForwardPacer() if pace else None
        self.engine = TransferEngine(self.storages.by_tier, copy_engine=self._copy_engine,
                                     store_nice=self.settings.store_nice, pacer=self.pacer)
        self._executor = EngineExecutor(self.engine, self._finished)
        if self.settings.export:
            self._export = G2Export(self.settings, self.storages.by_tier[HOST], self.rank,
                                    self.world_size)
        if self.settings.peers:
            self._remote = RemoteLoader(self.settings, g1, self.rank, self.world_size)
        log.info("kvstrata: worker %d holds %s", self.rank,
                 ", ".join(f"{t}={s.config.num_blocks} blocks"
                           for t, s in self.storages.by_tier.items()))

    def _shared_host(self, identity) -> SharedHost | None:
        """The G2 this worker's group keeps once (None: it keeps its own)."""
        if self.settings.shared_host_dir is None or self.settings.replicas <= 1:
            return None
        return SharedHost(self.settings.shared_host_dir, f"{self.server}-r{identity.rank}",
                          identity.writer)

    def _build(self, kv, options: StorageOptions) -> Storages:
        """The storages; a worker that follows another's durable G3 (and shared G2) first
        waits for that worker to have made them (they start together: up to
        :data:`WRITER_WAIT` seconds), then retries while that worker may still be taking
        its G3 over after a restart (up to :data:`TAKEOVER_WAIT` seconds, so that a lasting
        problem is reported soon)."""
        if not options.follow_durable:
            return build_storages(kv, options)
        deadline = time.monotonic() + WRITER_WAIT
        writer = self.rank - self.rank % self.settings.replicas
        for tier in kv.tiers:
            while not kind_of(tier).followed_exists(kv, tier, options):
                if time.monotonic() > deadline:
                    raise TierSetupError(
                        f"worker {self.rank} reads the {tier} that worker {writer} writes, "
                        f"which did not appear in {WRITER_WAIT:.0f} s in "
                        f"{kind_of(tier).followed_where(kv, tier, options)}")
                time.sleep(0.05)
        deadline = min(deadline, time.monotonic() + TAKEOVER_WAIT)
        while True:
            try:
                return build_storages(kv, options)
            except TierSetupError as exc:
                if time.monotonic() > deadline:
                    raise TierSetupError(f"worker {self.rank} cannot read the tiers worker "
                                         f"{writer} writes: {exc}") from exc
                log.info("kvstrata: worker %d waits for worker %d's tiers: %s", self.rank,
                         writer, exc)
                time.sleep(0.5)

    @property
    def outstanding(self) -> int:
        """Plans submitted whose result was not taken yet, and remote loads running."""
        return len(self._outstanding) + (self._remote.pending if self._remote else 0)

    # -- per step --------------------------------------------------------------------------
    def start(self, orders: StepOrders) -> None:
        """Take a step's orders (the step's forward is about to run): start every plan that
        does not read vLLM's KV."""
        if self.pacer is not None:
            self.pacer.forward_started()
        for tier, slots in orders.forget.items():
            forget = getattr(self.storages.by_tier.get(tier), "forget", None)
            if forget is not None:
                try:
                    forget(slots)
                except OSError as exc:     # the step goes on: served no more, kept on disk
                    log.error("kvstrata: %s could not record %d cleared blocks (%s); a "
                              "restart before their slots are reused brings them back",
                              tier, len(slots), exc)
        for req_id, order in orders.loads.items():
            self._request_jobs[req_id] = set(order.job_ids)
            if order.unloadable:
                self._request_failed.setdefault(req_id, set()).update(order.unloadable)
            for job in order.job_ids:
                self._job_request[job] = req_id
            if not order.job_ids:
                self._finish_load(req_id)
        for req_id, load in orders.remote_loads.items():
            if self._remote is None:
                self._load_errors.update(load.block_ids)
                self._finished_recving.add(req_id)
            else:
                self._remote.submit(req_id, load)
        now = [p for p in orders.plans if p.src_tier != TOP_TIER]
        self._stores.extend(p for p in orders.plans if p.src_tier == TOP_TIER)
        self._bound_at = time.monotonic()
        self._submit(now)
        self._timing = (orders.step, time.perf_counter()) if orders.step else None

    def flush_g1_readers(self) -> None:
        """Wait until no copy reads vLLM's KV (requests were preempted: their blocks may be
        overwritten by this step's forward). Copies still reading after
        :data:`FLUSH_TIMEOUT` fail when they finish: what they copied may be the forward's."""
        self._drain(until=lambda: not self._reading_g1)
        self._overwritten |= self._reading_g1

    def save(self) -> None:
        """After the forward: time it if asked, start the stores (they read what the
        forward wrote)."""
        if self.pacer is not None:
            self.pacer.forward_ended()
        if self._timing is not None:
            step, started = self._timing
            self._forwards.append((step, time.perf_counter() - started))
            self._timing = None
        stores, self._stores = self._stores, []
        if stores:
            self._forward_written()
            forward = max(0.0, time.monotonic() - self._bound_at)
            self._waited.update((p.job_id, forward) for p in stores)
        self._submit(stores)

    def _forward_written(self) -> None:
        """Return once the step's forward has written the KV the stores read. On a GPU the
        forward is queued on the compute stream and may still run when vLLM calls
        ``wait_for_save``: wait for it (the thread sleeps; vLLM synchronises right after
        anyway, to sample). On a CPU the forward has already returned."""
        g1 = self.storages.by_tier[TOP_TIER] if self.storages is not None else None
        device = getattr(g1, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def finished(self) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving): loads whose plans all completed."""
        self._drain()
        if self._remote is not None:
            for req_id, failed in self._remote.finished():
                self._load_errors.update(failed)
                self._finished_recving.add(req_id)
        done, self._finished_recving = self._finished_recving, set()
        return set(), done

    def load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (vLLM recomputes from
        the first of them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def failed_requests(self) -> set[str]:
        """Requests whose load failed since the last call, with several KV cache groups
        (vLLM cannot map block ids of several groups back: it recomputes such a request
        whole). Each was also reported finished by :meth:`finished`."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def report(self) -> WorkerReport | None:
        self._drain()
        recovered = self._recovered
        if not self._reported and recovered is None and not self._forwards:
            return None
        report, self._reported = WorkerReport(self._reported, forwards=self._forwards), []
        self._forwards = []
        if recovered is not None:          # once, even if empty: the scheduler counts ranks
            report.recovered[self.rank] = recovered
            self._recovered = None
        return report

    def shutdown(self) -> None:
        """Finish the copies in flight (bounded wait), then free the storages."""
        if self.pacer is not None:
            self.pacer.close()
            log.info("kvstrata: worker %d held writes to lower tiers back during forwards: "
                     "%s", self.rank, self.pacer.counters.to_dict())
        self.save()
        self._drain(until=lambda: not self._outstanding)
        self._stop_copies()
        if self.storages is not None:
            self.storages.close()
            self.storages = None

    def _stop_copies(self) -> None:
        """Close what reads or writes the storages: the peers, the export, the engine."""
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        if self._export is not None:
            self._export.close()
            self._export = None
        if self.engine is not None:
            self.engine.close(cancel_pending=True)
            self.engine = None

    # -- helpers ---------------------------------------------------------------------------
    def _submit(self, plans: list[TransferPlan]) -> None:
        if not plans:
            return
        if self._executor is None:
            for plan in plans:
                self._finished(TransferResult.failed(plan, FailureKind.INTERNAL,
                                                     "the worker has no storages"))
            return
        if self._written_elsewhere:
            elsewhere = [p for p in plans if p.dst_tier in self._written_elsewhere]
            plans = [p for p in plans if p.dst_tier not in self._written_elsewhere]
            for plan in elsewhere:
                self._outstanding.add(plan.job_id)
                self._finished(TransferResult.done_elsewhere(plan))
        for plan in plans:
            self._outstanding.add(plan.job_id)
            if plan.src_tier == TOP_TIER:
                self._reading_g1.add(plan.job_id)
        if plans:
            self._executor.submit(plans)

    def _drain(self, until: Callable[[], bool] | None = None) -> None:
        """Take finished copies: results for the scheduler, finished loads for vLLM. With
        ``until``, block (sleeping on the result queue) until it holds or a timeout."""
        deadline = time.monotonic() + FLUSH_TIMEOUT
        while True:
            if until is not None and not until():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.error("kvstrata: copies still running after %g s", FLUSH_TIMEOUT)
                    return
                try:
                    finished_at, result = self._done.get(timeout=remaining)
                except queue.Empty:
                    continue
            else:
                try:
                    finished_at, result = self._done.get_nowait()
                except queue.Empty:
                    return
            self._take(result, finished_at)

    def _finished(self, result: TransferResult) -> None:
        if result.plan.job_id in self._overwritten:     # at once: an export may lease it
            self._unseal(result.plan)
        self._done.put((time.monotonic(), result))

    def _unseal(self, plan: TransferPlan) -> None:
        """The blocks copy ``plan`` wrote are not what they are named (the copy read what a
        forward overwrote): they are no longer served from their tier, to a peer's lease
        either, and a durable tier's journal forgets them."""
        storage = self.storages.by_tier.get(plan.dst_tier) if self.storages else None
        ids = [b for b in plan.dst_block_ids if b >= 0]
        if storage is None or not ids:
            return
        try:
            forget = getattr(storage, "forget", None)
            if forget is not None:
                forget(ids)
            elif getattr(storage, "checksums", None) is not None:
                storage.checksums.invalidate(ids)
        except OSError as exc:
            log.error("kvstrata: %s could not drop %d blocks copied from overwritten KV (%s)",
                      plan.dst_tier, len(ids), exc)

    def _take(self, result: TransferResult, finished_at: float) -> None:
        # Neither the time a store waited for the forward that writes what it reads, nor
        # the time the result waited to be taken (vLLM calls in once per engine step; an
        # engine nobody steps calls in later) is the copy's latency: counted, they taught
        # the cost model a forward's worth of overhead per store, then seconds as an
        # offline engine went idle, and it declined loads (priced from the store path).
        waited = self._waited.pop(result.plan.job_id, 0.0)
        result = replace(result, waited_seconds=waited
                         + max(0.0, time.monotonic() - finished_at))
        job = result.plan.job_id
        if job in self._overwritten:
            self._overwritten.discard(job)
            self._unseal(result.plan)
            result = replace(TransferResult.failed(
                result.plan, FailureKind.INTERNAL, "vLLM's forward overwrote the blocks this "
                "copy read (a flush gave up waiting for it)"),
                waited_seconds=result.waited_seconds)
        self._outstanding.discard(job)
        self._reading_g1.discard(job)
        if self._executor is not None:
            self._executor.settled(result)
        self._reported.append((self.rank, result))
        req_id = self._job_request.pop(job, None)
        if req_id is None:
            return
        if not result.all_ok:
            ids = result.plan.dst_block_ids
            self._request_failed.setdefault(req_id, set()).update(
                ids[i] for i, ok in enumerate(result.ok) if not ok)
        jobs = self._request_jobs.get(req_id)
        if jobs is not None:
            jobs.discard(job)
            if not jobs:
                self._finish_load(req_id)

    def _finish_load(self, req_id: str) -> None:
        self._request_jobs.pop(req_id, None)
        failed = self._request_failed.pop(req_id, None)
        if failed and self.settings.groups.single:
            self._load_errors.update(failed)
        elif failed:
            self._failed_requests.add(req_id)
        self._finished_recving.add(req_id)
