"""Executors: what runs a planner's plans and hands their results back.

* :class:`ImmediateExecutor` completes every plan at once as a success, moving no bytes: the
  metadata replay's executor (placement decisions only). :func:`drive` runs a planner with it
  until nothing is left to do.
* :class:`EngineExecutor` submits plans to an in-process
  :class:`~kvstrata.physical.TransferEngine` without ever blocking: a path whose queue is
  full keeps its plans in a backlog, submitted as that path's results come back. Each result
  is handed to ``deliver`` from the engine's worker thread; the owner of the planner takes it
  from there (``KvBlockManager`` posts it to its owner thread).

A connector's workers are the third kind: they receive plans over the wire
(:meth:`~kvstrata.protocol.TransferPlan.to_dict`) and report
:class:`~kvstrata.protocol.TransferResult` s back the same way.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterable

from ..protocol.errors import EngineBusyError
from ..protocol.plans import TransferPlan
from ..protocol.results import FailureKind, TransferResult

if TYPE_CHECKING:
    from ..physical.transfer import TransferEngine
    from .planner import Planner

__all__ = ["ImmediateExecutor", "EngineExecutor", "drive"]

log = logging.getLogger(__name__)


class ImmediateExecutor:
    """Every plan succeeds at once, with no bytes moved."""

    def run(self, plans: Iterable[TransferPlan]) -> list[TransferResult]:
        return [TransferResult.success(plan) for plan in plans]


def drive(planner: "Planner", executor: ImmediateExecutor | None = None) -> None:
    """Run ``planner``'s plans through ``executor`` (an :class:`ImmediateExecutor` by
    default), results included, until it hands out no more plans."""
    executor = executor or ImmediateExecutor()
    while True:
        plans = planner.take_plans()
        if not plans:
            return
        planner.complete(executor.run(plans))


class EngineExecutor:
    """Runs plans on a :class:`~kvstrata.physical.TransferEngine`; see the module docstring.

    Call :meth:`submit` and :meth:`settled` from the planner's thread. ``deliver(result)``
    is called once per submitted plan, from a transfer worker (or, for a plan the engine
    refused, from :meth:`submit` itself) with a result whose failed blocks say why.
    """

    def __init__(self, engine: "TransferEngine",
                 deliver: Callable[[TransferResult], None]) -> None:
        self.engine = engine
        self._deliver = deliver
        self._backlog: dict[str, deque[TransferPlan]] = {}

    @property
    def backlogged(self) -> int:
        """Plans waiting for room on their path."""
        return sum(len(b) for b in self._backlog.values())

    def submit(self, plans: Iterable[TransferPlan]) -> None:
        """Submit ``plans`` (each in its path's order behind any backlog)."""
        for plan in plans:
            backlog = self._backlog.setdefault(plan.path, deque())
            if backlog or not self._try_submit(plan):
                backlog.append(plan)

    def settled(self, result: TransferResult) -> None:
        """``result`` was handed to the planner: its path has room for backlogged plans."""
        backlog = self._backlog.get(result.plan.path)
        while backlog and self._try_submit(backlog[0]):
            backlog.popleft()

    def _try_submit(self, plan: TransferPlan) -> bool:
        """False if the plan's path is busy; any other refusal becomes a failed result."""
        try:
            future = self.engine.submit(plan, timeout=0)
        except EngineBusyError:
            return False
        except Exception as exc:   # engine closed, a plan it refuses, a bug: the copy fails
            log.warning("kvstrata: plan %d (%s) not submitted: %s", plan.job_id, plan.path, exc)
            self._deliver(TransferResult.failed(plan, FailureKind.INTERNAL,
                                                f"not submitted: {exc}"))
            return True
        future.add_done_callback(lambda f, p=plan: self._deliver(_result_of(f, p)))
        return True


def _result_of(future: Future, plan: TransferPlan) -> TransferResult:
    if future.cancelled():
        return TransferResult.failed(plan, FailureKind.INTERNAL, "transfer cancelled")
    exc = future.exception()
    if exc is not None:
        return TransferResult.failed(plan, FailureKind.INTERNAL, f"transfer failed: {exc!r}")
    return future.result()
