"""What the planner checks before it changes anything: the results a driver hands back
(:func:`check_results`) and the engine block ids it names (:func:`engine_ids`). A call that
fails a check raises :class:`PlacementError` and leaves the planner as it was."""

from __future__ import annotations

import numbers
from typing import Mapping, Sequence

from ..protocol.plans import TransferPlan
from ..protocol.results import BlockFailure, FailureKind, TransferResult
from .state import Job

__all__ = ["PlacementError", "check_results", "engine_ids"]

_BOOL = {bool}


class PlacementError(ValueError):
    """A call the planner refuses, before anything changed: a result for a job it did not
    hand out (or for a different plan), engine block ids that do not fit the request, a tier
    it does not manage."""


def check_results(jobs: Mapping[int, Job], results: list) -> list[tuple[Job, TransferResult]]:
    """Each of ``results`` with the job in flight (of ``jobs``) it answers; ``PlacementError``
    if one answers no job handed out, answers it twice, answers a different plan, or is
    malformed (``ok`` not one bool per block, failures that do not name a failed block once
    with a known kind)."""
    checked: list[tuple[Job, TransferResult]] = []
    seen: set[int] = set()
    for result in results:
        if not isinstance(result, TransferResult):
            raise PlacementError(f"complete: expected TransferResult, got "
                                 f"{type(result).__name__}")
        job = jobs.get(result.plan.job_id) if isinstance(result.plan, TransferPlan) \
            else None
        if job is None or job.taken_at == 0.0 or result.plan.job_id in seen:
            raise PlacementError(f"complete: no plan {getattr(result.plan, 'job_id', '?')!r}"
                                 f" is in flight (unknown, not handed out yet, already "
                                 f"completed, or twice in one call)")
        if result.plan is not job.plan and result.plan != job.plan:
            raise PlacementError(f"complete: the result of job {job.plan.job_id} answers a "
                                 f"different plan than the one handed out")
        n = len(job.plan)
        ok = result.ok
        if not isinstance(ok, tuple) or len(ok) != n or not set(map(type, ok)) <= _BOOL:
            raise PlacementError(f"complete: job {job.plan.job_id}: ok must be {n} bools")
        failures = result.failures
        if not isinstance(failures, tuple):
            raise PlacementError(f"complete: job {job.plan.job_id}: failures must be a "
                                 f"tuple of BlockFailure")
        positions: set[int] = set()
        for failure in failures:
            position = getattr(failure, "position", None)
            if not isinstance(failure, BlockFailure) \
                    or not isinstance(failure.kind, FailureKind) \
                    or type(position) is not int or not 0 <= position < n \
                    or ok[position] or position in positions:
                raise PlacementError(f"complete: job {job.plan.job_id}: failure {failure!r} "
                                     f"does not name a failed block once, with a known kind")
            positions.add(position)
        seen.add(job.plan.job_id)
        checked.append((job, result))
    return checked


def engine_ids(ids: Sequence[int] | None, count: int, what: str) -> list[int]:
    """``ids`` as ``count`` distinct non-negative ints (engine block ids handed to ``what``);
    ``PlacementError`` otherwise."""
    if ids is None:
        raise PlacementError(f"{what}: the engine owns the top tier; give engine_block_ids")
    ids = [int(b) if isinstance(b, numbers.Integral) and not isinstance(b, bool) else b
           for b in ids]
    if len(ids) != count:
        raise PlacementError(f"{what}: {count} blocks but {len(ids)} engine block ids")
    for i, block_id in enumerate(ids):
        if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
            raise PlacementError(f"{what}: engine_block_ids[{i}] = {block_id!r} is not a "
                                 f"block id")
    if len(set(ids)) != len(ids):
        raise PlacementError(f"{what}: engine_block_ids contains duplicates")
    return ids
