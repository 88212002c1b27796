"""The owner thread: the one thread that touches a manager's pools and planner.

Public calls post a :class:`Command` to :attr:`OwnerThread.queue` and get a
``concurrent.futures.Future``; transfer workers post their results to the same queue, so the
owner sleeps on one queue and never polls. After each item the owner runs the manager's
``after`` step (submit new plans, deliver finished onboards, wake idle waiters).

If handling an item raises (a bug outside any one request), the owner *breaks*: the state is
suspect, so every waiter fails with :class:`~kvstrata.manager.errors.ManagerError`, later
calls are refused, and queued commands fail as they come up. Closing stops the thread after
the stop marker; nothing is posted behind it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from .errors import ManagerClosedError, ManagerError

__all__ = ["Command", "OwnerThread", "STOP", "resolved"]

log = logging.getLogger(__name__)

STOP = object()
"""The marker that ends the owner thread's loop."""


def resolved(value: object = None, error: BaseException | None = None) -> Future:
    """A future that is already done."""
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


class Command:
    """A call to run on the owner thread. ``deferred`` calls resolve the future themselves
    (they receive it as their argument)."""

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


class OwnerThread:
    """Runs commands and handles posted items on one thread (see the module docstring).

    ``handle(item)`` handles anything posted that is not a :class:`Command`; ``after()``
    runs after every item; ``on_break(error)`` fails what the manager keeps waiting.
    """

    def __init__(self, name: str, handle: Callable[[object], None], after: Callable[[], None],
                 on_break: Callable[[ManagerError], None]) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.idle_waiters: list[Future] = []
        """Futures of :meth:`KvBlockManager.flush`, resolved once nothing is pending."""
        self._handle, self._after, self._on_break = handle, after, on_break
        self.closed = False            # close() started: public calls are refused
        # Guards stopped/broken together with posting to the queue, so nothing is posted
        # after the stop marker (it would never run).
        self._state_lock = threading.Lock()
        self.stopped = False
        self.broken: ManagerError | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def call(self, fn: Callable, deferred: bool = False, *, internal: bool = False) -> Future:
        """Post ``fn`` to the owner. ``internal`` calls (release, flush, status) are still
        accepted while the manager closes; none after the owner stopped
        (``ManagerClosedError``) or broke (``ManagerError``)."""
        command = Command(fn, deferred)
        with self._state_lock:
            if self.stopped or (self.closed and not internal):
                raise ManagerClosedError("block manager is closed")
            if self.broken is not None:
                raise ManagerError(str(self.broken)) from self.broken.__cause__
            self.queue.put(command)
        return command.future

    def post(self, item: object) -> None:
        """Hand a worker's item (a transfer result) to the owner; any thread."""
        self.queue.put(item)

    def wake_idle(self) -> None:
        """Resolve the idle waiters (the caller saw that nothing is pending)."""
        waiters, self.idle_waiters = self.idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def stop(self) -> None:
        """Queue the stop marker and wait for the thread to end."""
        with self._state_lock:
            self.stopped = True
            self.queue.put(STOP)
        self.thread.join()

    def _run(self) -> None:
        get = self.queue.get
        while True:
            item = get()
            if item is STOP:
                return
            if self.broken is not None:
                self._refuse(item)
                continue
            try:
                if isinstance(item, Command):
                    item.run()                    # errors go to the caller's future
                else:
                    self._handle(item)
                self._after()
            except Exception as exc:   # a bug outside any one request: the state is suspect
                log.exception("kvstrata manager owner thread failed handling %r", item)
                self._break(exc)

    def _break(self, cause: Exception) -> None:
        """Mark the owner broken and fail everything still waiting."""
        error = ManagerError(f"kvstrata manager failed on its owner thread ({cause!r}); it "
                             f"accepts no more calls, close it")
        error.__cause__ = cause
        with self._state_lock:
            self.broken = error
        waiters, self.idle_waiters = self.idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)
        try:
            self._on_break(error)
        except Exception:
            log.exception("kvstrata manager: failing outstanding calls failed")

    def _refuse(self, item: object) -> None:
        """A broken owner fails queued commands and drops everything else."""
        if isinstance(item, Command) and item.future.set_running_or_notify_cancel():
            item.future.set_exception(self.broken)
