"""The planner's shared bookkeeping: tiers and pools, jobs in flight, what each tier is
receiving, quarantined blocks, and the listeners that hear about it.

:class:`PlacementState` is owned by one :class:`~kvstrata.placement.planner.Planner` and read
and written by its two halves, :mod:`.offload` and :mod:`.onboard`. A :class:`Job` is one
transfer plan handed to an executor plus what it keeps alive until its result comes back:
the held source blocks (so they are not evicted mid-copy) and the target slots (allocated,
not yet registered). Blocks in an engine-owned top tier are neither: the job only remembers
their ids so the engine can be told they are in use.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..logical.admission import AdmissionPolicy
from ..logical.handles import ImmutableBlocks, MutableBlocks
from ..logical.pool import BlockPool
from ..protocol.plans import Endpoint, TransferPlan
from ..tiers import Addressing, spec
from ..types import BlockRecord
from .costs import CostModel
from .telemetry import PlacementListener, PlacementStats
from .tenants import TenantLedger

__all__ = ["Job", "PlacementState"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One plan and what it keeps alive until its result is taken."""

    plan: TransferPlan
    records: list[BlockRecord]
    source: ImmutableBlocks | None
    """Source blocks held for the copy; None when the source is an engine-owned block."""
    target: MutableBlocks | None
    """Target slots, Complete and unregistered; None when the target is an engine's block."""
    ticket: Any = None
    """The onboard this copy serves (an :class:`~.onboard.Ticket`, opaque here: only the
    onboard reads it); None for an offload."""
    engine_blocks: tuple[int, ...] = ()
    """Engine-owned top-tier block ids this job reads or writes."""
    engine_written: tuple[int, ...] = ()
    """Those of them it writes (an onboard's targets)."""
    taken_at: float = 0.0
    settled: bool = False
    """Its onboard has counted it as done."""
    tenant: str | None = None
    """Whose blocks an offload copies (:mod:`.tenants`; None, unknown, only without quotas:
    with them a block no tier knows the tenant of is :data:`~.tenants.RECOVERED_TENANT`'s)."""

    @property
    def path(self) -> str:
        return self.plan.path

    @property
    def src_tier(self) -> str:
        return self.plan.source.tier

    @property
    def dst_tier(self) -> str:
        return self.plan.target.tier


class PlacementState:
    """Everything the planner's halves share; owner-thread only, like the pools."""

    def __init__(self, tier_names: Sequence[str], pools: dict[str, BlockPool],
                 admission: dict[str, AdmissionPolicy], *, engine_owns_top: bool,
                 worker: int, key_of: Callable[[BlockRecord], str],
                 listeners: Iterable[PlacementListener],
                 costs: CostModel | None = None,
                 tenants: TenantLedger | None = None) -> None:
        self.tiers = tuple(tier_names)
        """Configured tiers, fastest first."""
        self.pools = pools
        """The pools kvstrata owns: every configured tier but an engine-owned top one."""
        self.admission = admission
        self.engine_owns_top = engine_owns_top
        self.worker = worker
        self.key_of = key_of
        self.stats = PlacementStats()
        self.costs = costs
        self.blocks_in_flight: Counter[str] = Counter()
        """Blocks of the jobs in flight (handed out or not yet), by path: what a new copy on
        that path waits behind."""
        learners = (self.stats,)
        if costs is not None:
            costs.attach_backlog(lambda path: self.blocks_in_flight.get(path, 0))
            learners += (costs,)
        self.listeners: tuple[PlacementListener, ...] = (*learners, *listeners)
        self.receiving: dict[str, set[int]] = {t: set() for t in self.tiers}
        """Hashes on their way into each tier (copies in flight or waiting for a slot)."""
        self.quarantine: dict[str, set[int]] = {t: set() for t in self.tiers}
        """Blocks found bad while in use: never served, dropped once idle."""
        self.jobs: dict[int, Job] = {}
        self.outbox: list[Job] = []
        self.engine_blocks: Counter[int] = Counter()
        """Engine-owned block ids that jobs in flight read or write, with counts."""
        self.engine_writing: Counter[int] = Counter()
        """Those that onboards in flight write."""
        self.waiting = 0
        """Batches waiting for a slot in their target tier (see :mod:`.offload`)."""
        self.tenants = tenants
        """Whose blocks each tier holds, and their quotas; None when no quota is set."""
        self._next_job = 1
        self._endpoints = {t: Endpoint(t, worker) for t in self.tiers}

    # -- tiers -----------------------------------------------------------------------------
    @property
    def top(self) -> str:
        return self.tiers[0]

    def below(self, tier: str) -> str | None:
        """The next configured tier under ``tier`` (None at the bottom)."""
        index = self.tiers.index(tier) + 1
        return self.tiers[index] if index < len(self.tiers) else None

    def holder(self, sequence_hash: int, tiers: Sequence[str]) -> str | None:
        """The first of ``tiers`` holding ``sequence_hash`` outside quarantine."""
        for tier in tiers:
            if sequence_hash in self.pools[tier] and sequence_hash not in self.quarantine[tier]:
                return tier
        return None

    # -- jobs ------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Jobs not completed plus batches waiting for a slot."""
        return len(self.jobs) + self.waiting

    def new_job(self, source_tier: str, target_tier: str, records: list[BlockRecord], *,
                source: ImmutableBlocks | None = None, target: MutableBlocks | None = None,
                engine_src: Sequence[int] = (), engine_dst: Sequence[int] = (),
                ticket: Any = None, tenant: str | None = None) -> Job:
        """Plan copying ``records`` from ``source_tier`` to ``target_tier`` and queue the plan
        for the next :meth:`take_plans`. Each side is a held pool handle or engine block ids;
        an offload's ``tenant`` counts them against its quota until the copy ends."""
        hashes = tuple(r.sequence_hash for r in records)
        src_ids, src_keys = self._address(source_tier, records,
                                          source.block_ids if source is not None else engine_src)
        dst_ids, dst_keys = self._address(target_tier, records,
                                          target.block_ids if target is not None else engine_dst)
        job_id = self._next_job
        self._next_job += 1
        parents: tuple = ()
        locals_: tuple = ()
        if spec(target_tier).persistent:   # stored blocks outlive us: they keep their identity
            parents = tuple(r.parent_hash for r in records)
            locals_ = tuple(r.local_hash for r in records)
        plan = TransferPlan.trusted(job_id, self._endpoints[source_tier],
                                    self._endpoints[target_tier], hashes, src_ids, dst_ids,
                                    src_keys, dst_keys, parents, locals_)
        engine = (*engine_src, *engine_dst)
        job = Job(plan, records, source, target, ticket, engine, tuple(engine_dst),
                  tenant=tenant)
        if self.tenants is not None and ticket is None:
            self.tenants.coming(target_tier, tenant, records, True)
        self.jobs[job_id] = job
        self.blocks_in_flight[job.path] += len(hashes)
        self.outbox.append(job)
        if engine:
            self.engine_blocks.update(engine)
            self.engine_writing.update(engine_dst)
        self.announce_pending()
        return job

    def _address(self, tier: str, records: Sequence[BlockRecord], ids: Sequence[int]
                 ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if spec(tier).addressing is Addressing.KEYS:
            return (), tuple(self.key_of(r) for r in records)
        return tuple(ids), ()

    def take_plans(self) -> list[TransferPlan]:
        """The plans made since the last call, stamped as handed out now."""
        if not self.outbox:
            return []
        now = time.perf_counter()
        jobs, self.outbox = self.outbox, []
        for job in jobs:
            job.taken_at = now
        return [job.plan for job in jobs]

    def close_job(self, job: Job) -> None:
        """``job``'s result was taken: it no longer counts as in flight."""
        if self.jobs.pop(job.plan.job_id, None) is not None:
            if self.tenants is not None and job.ticket is None:
                self.tenants.coming(job.dst_tier, job.tenant, job.records, False)
            left = self.blocks_in_flight[job.path] - len(job.plan.sequence_hashes)
            if left > 0:
                self.blocks_in_flight[job.path] = left
            else:
                del self.blocks_in_flight[job.path]
        if job.engine_blocks:
            _forget(self.engine_blocks, job.engine_blocks)
            _forget(self.engine_writing, job.engine_written)
        self.announce_pending()

    def announce_pending(self) -> None:
        pending = self.pending
        for listener in self.listeners:
            listener.in_flight(pending)

    # -- reporting -------------------------------------------------------------------------
    def admitted(self, tier: str, records: Sequence[BlockRecord]) -> list[int]:
        """The positions of ``records`` (in chain order) that ``tier`` takes: those its
        admission filter admits, and, for a filter that keeps prefixes whole
        (``keeps_prefixes``), none whose parent is in the same offer and was not taken:
        alone, without its prefix, a block could never hit. (Only within the offer: a
        block whose parent was never offered here, as a sliding-window or linear-attention
        group's blocks, is the engine's layout, not a refusal.) Refusals are counted as
        skipped for ``admission``."""
        admission = self.admission[tier]
        if type(admission) is AdmissionPolicy:
            return list(range(len(records)))
        yes = admission.admit_many([r.sequence_hash for r in records])
        if admission.keeps_prefixes:
            dropped = {r.sequence_hash for r, y in zip(records, yes) if not y}
            for i, record in enumerate(records):
                if yes[i] and record.parent_hash in dropped:
                    yes[i] = False
                    dropped.add(record.sequence_hash)
        out = [i for i, y in enumerate(yes) if y]
        self.skipped(tier, "admission", len(records) - len(out))
        return out

    def skipped(self, tier: str, reason: str, count: int) -> None:
        if count:
            for listener in self.listeners:
                listener.skipped(tier, reason, count)

    def transfer_done(self, job: Job, ok_blocks: int, nbytes: int, busy: float,
                      failures: Iterable[tuple[str, int]], held: float = 0.0) -> None:
        """Tell the listeners a job's copy ended; ``held`` seconds of it were not the path's
        latency (held back on purpose, or its result waiting to be collected)."""
        latency = time.perf_counter() - job.taken_at if job.taken_at else 0.0
        if latency:
            latency = max(latency - held, busy)
        failures = list(failures)
        for listener in self.listeners:
            listener.transfer_done(job.path, ok_blocks, nbytes, busy, latency, failures)

    # -- bad blocks ------------------------------------------------------------------------
    def drop(self, tier: str, hashes: Iterable[int]) -> None:
        """Drop bad blocks from ``tier`` (with their descendants, unreachable without them);
        those still in use are quarantined (never served, dropped as soon as they are
        free). Also retries the blocks already quarantined there."""
        quarantine = self.quarantine[tier]
        pool = self.pools[tier]
        wanted = [h for h in (*hashes, *quarantine) if h in pool]
        if not wanted and not quarantine:
            return
        pool.drop_with_descendants(wanted)
        quarantine.clear()
        quarantine.update(h for h in wanted if h in pool)

    def without_tainted(self, job: Job, good: MutableBlocks | None) -> MutableBlocks | None:
        """The copied target blocks of ``job`` minus those whose source was found bad
        (quarantined) while the copy ran: their bytes may be wrong, so they are given back,
        not registered. Call before the source hold is released (that may drop them)."""
        tainted = self.quarantine[job.src_tier]
        if good is None or not tainted:
            return good
        good, spoiled = good.split([b.sequence_hash not in tainted for b in good.blocks])
        if spoiled is not None:
            spoiled.pool.release(spoiled)
        return good

    def retry_quarantine(self) -> None:
        for tier, hashes in self.quarantine.items():
            if hashes:
                self.drop(tier, ())

    @staticmethod
    def release_quietly(handle) -> None:
        """Release ``handle`` on a cleanup path: a failure is logged, never raised."""
        try:
            if handle is not None and not handle.released:
                handle.pool.release(handle)
        except Exception:
            log.exception("kvstrata: could not release a %s handle", handle.pool.tier)


def _forget(counts: Counter, ids: Sequence[int]) -> None:
    """Count ``ids`` out of ``counts``, removing those that reach zero."""
    counts.subtract(ids)
    for block_id in ids:
        if counts[block_id] <= 0:
            del counts[block_id]
