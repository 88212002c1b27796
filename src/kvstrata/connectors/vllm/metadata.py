"""What crosses between the connector's halves each engine step (pickled by vLLM).

Scheduler -> workers: :class:`StepOrders` (a ``KVConnectorMetadata``): the transfer plans the
planner made this step and, per request that waits for a load, which plans fill it and which
of its blocks cannot be loaded at all. Workers -> scheduler: :class:`WorkerReport` (a
``KVConnectorWorkerMetadata``): the results of the plans each worker finished, one
:class:`~kvstrata.protocol.TransferResult` per plan per worker; vLLM combines the reports of
all tensor-parallel ranks with :meth:`WorkerReport.aggregate` and the scheduler waits for every
rank's result of a plan before applying it (:class:`RankResults`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)

from ...protocol.plans import TransferPlan
from ...protocol.results import BlockFailure, FailureKind, TransferResult

__all__ = ["LoadOrder", "StepOrders", "WorkerReport", "RankResults"]


@dataclass(frozen=True)
class LoadOrder:
    """One request waiting for a load: the plans (job ids) that fill its blocks, and engine
    block ids promised to vLLM that no plan fills (reported as load errors at once)."""

    job_ids: tuple[int, ...]
    unloadable: tuple[int, ...] = ()


@dataclass
class StepOrders(KVConnectorMetadata):
    """The scheduler's orders for one step.

    ``plans`` run in the worker: plans reading vLLM's KV (G1 sources, the stores) after the
    step's forward wrote it, all others (loads, the cascade below G2) at once. ``loads`` maps
    request ids to their :class:`LoadOrder`. ``flush`` asks the worker to finish every copy
    reading vLLM's KV before the forward (requests were preempted: their blocks may be
    reused this step). ``step``, when not 0, asks the workers to time this step's forward
    and report it under that number (a step that prefills: the engine's prefill rate)."""

    plans: list[TransferPlan] = field(default_factory=list)
    loads: dict[str, LoadOrder] = field(default_factory=dict)
    flush: bool = False
    step: int = 0
    remote_loads: dict[str, Any] = field(default_factory=dict)
    """Request id -> :class:`~.sharing.RemoteLoad`: prefixes to read from a peer engine."""
    forget: dict[str, list[int]] = field(default_factory=dict)
    """Per tier, slots whose blocks were dropped for good (``reset_cache``): the workers'
    storages forget them (a durable tier journals it) before this step's plans run, which
    may write the same slots again."""


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Results of finished plans, from one worker or (after :meth:`aggregate`) several."""

    results: list[tuple[int, TransferResult]] = field(default_factory=list)
    """(worker rank, result) pairs."""
    recovered: dict[int, dict[str, list[tuple[int, int, int | None, int]]]] = \
        field(default_factory=dict)
    """Once per worker, in its first report: per durable tier, the blocks it recovered at
    start as (slot, sequence hash, parent hash, local hash), keyed by the worker's rank."""
    forwards: list[tuple[int, float]] = field(default_factory=list)
    """(step, seconds) the forward of each step the scheduler asked to time took."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "WorkerReport":
        if isinstance(other, WorkerReport):
            self.results.extend(other.results)
            self.recovered.update(other.recovered)
            self.forwards.extend(other.forwards)
        return self


class RankResults:
    """Collects each plan's result from every worker and combines them.

    Every worker (tensor-parallel rank, pipeline stage) moves its own share of each block (its
    KV heads, its layers), so a block arrived only if it arrived on every worker: the combined
    result is ok where all are ok, carries the first failure of each failed position, and sums
    the bytes moved. Each worker reports each plan once, so results are counted, not keyed by
    the rank they carry (which is only for diagnostics). With one worker, results pass
    straight through."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._partial: dict[int, list[TransferResult]] = {}

    @property
    def waiting(self) -> int:
        """Plans some but not all ranks reported."""
        return len(self._partial)

    def add(self, rank: int, result: TransferResult) -> TransferResult | None:
        """Record ``rank``'s result; the combined result once every rank reported."""
        if self.world_size == 1:
            return result
        got = self._partial.setdefault(result.plan.job_id, [])
        got.append(result)
        if len(got) < self.world_size:
            return None
        del self._partial[result.plan.job_id]
        return combine(got)


def combine(results: list[TransferResult]) -> TransferResult:
    """One result for a plan from the results of every rank (see :class:`RankResults`)."""
    first = results[0]
    n = len(first.plan)
    ok = tuple(all(r.ok[i] for r in results) for i in range(n))
    failures: dict[int, BlockFailure] = {}
    for r in results:
        for f in r.failures:
            failures.setdefault(f.position, f)
    for i in range(n):
        if not ok[i] and i not in failures:
            failures[i] = BlockFailure(i, first.plan.dst_block_ids[i] if
                                       first.plan.dst_block_ids else -1,
                                       FailureKind.INTERNAL, "failed on another rank")
    # a rank whose blocks another wrote reports no checksum: take one that says
    checksums = tuple(next((r.checksums[i] for r in results if r.checksums[i] is not None),
                           None) if ok[i] else None for i in range(n))
    errors = [r.error for r in results if r.error]
    # the time a plan took is that of the ranks that moved its bytes (not of those whose
    # blocks another rank wrote for them: done at once, they time nothing)
    timed = [r for r in results if r.moved_here] or results
    return TransferResult(first.plan, ok, checksums,
                          sum(r.bytes_moved for r in results),
                          max(r.seconds for r in timed),
                          tuple(failures[i] for i in sorted(failures)),
                          "; ".join(errors) if errors else None,
                          max(r.held_seconds for r in timed),
                          min(r.waited_seconds for r in timed),
                          all(r.moved_here for r in timed))

