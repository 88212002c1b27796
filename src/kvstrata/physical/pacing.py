"""Background writes that step aside while the engine's forward pass runs.

Where the engine computes on the host's own cores (vLLM's CPU build), every byte kvstrata
moves in the background takes CPU from the forward pass: its own copies and checksums, the
kernel's network stack, and an object store or disk server on the same host. A forward's
threads usually wait for each other (OpenMP), so a core taken from one slows them all. The
writes away from the engine (G2 -> G3, G2 -> G4, G3 -> G4) are never urgent: they can wait
for the gap between two forwards.

:class:`ForwardPacer` is that gate. The engine's driver calls
:meth:`~ForwardPacer.forward_started` before a forward and
:meth:`~ForwardPacer.forward_ended` after it; a background write calls
:meth:`~ForwardPacer.wait` before each unit of work (a round of object PUTs, a disk plan) and is held
while a forward runs, at most :attr:`~ForwardPacer.max_hold` seconds per unit, so a forward
that never ends (a hung engine) only slows writes down. Work already started is not
interrupted. Loads (towards the engine) and the copies out of the engine's own memory are
never paced: the engine waits for the first, and the second hold the engine's blocks.

A plan's time held back must not count as the path being slow (the cost model learns
bandwidth and overhead from each plan's seconds): :meth:`ForwardPacer.plan` gives a
:class:`PlanPacing` whose :attr:`~PlanPacing.held_seconds` is the time during which at
least one of the plan's requests waited at the gate and none of them ran.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

__all__ = ["ForwardPacer", "PlanPacing", "PacerCounters", "MAX_HOLD", "MAX_HOLD_LIMIT"]

MAX_HOLD = 5.0
"""Seconds a unit of background work waits for a forward to end before it goes anyway."""
MAX_HOLD_LIMIT = 3600.0
"""The largest ``max_hold`` accepted (a longer wait is a hang, and timeouts overflow)."""


@dataclass
class PacerCounters:
    """What a :class:`ForwardPacer` did since it was made."""

    forwards: int = 0           # forwards announced
    holds: int = 0              # units of work that waited for a forward to end
    held_seconds: float = 0.0   # their waits, summed
    overruns: int = 0           # waits that reached max_hold and went anyway

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class ForwardPacer:
    """Holds background writes back while the engine's forward runs (module docstring).

    Thread-safe: the forward is announced from the engine's thread, :meth:`wait` is called
    from any number of writer threads. After :meth:`close` nothing waits any more."""

    def __init__(self, max_hold: float = MAX_HOLD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= max_hold <= MAX_HOLD_LIMIT:
            raise ValueError(f"max_hold must be seconds in [0, {MAX_HOLD_LIMIT:.0f}], "
                             f"got {max_hold!r}")
        self.max_hold = float(max_hold)
        self.counters = PacerCounters()
        self.clock = clock
        self._cond = threading.Condition()
        self._forward = False
        self._closed = False
        self._started = 0          # forwards announced so far; the running one's number
        self._ended = 0            # the number of the last forward that ended

    @property
    def forward_running(self) -> bool:
        return self._forward

    def forward_started(self) -> None:
        """The engine's forward begins: background work waits from now on."""
        with self._cond:
            if not self._closed and not self._forward:
                self._forward = True
                self._started += 1
                self.counters.forwards += 1

    def forward_ended(self) -> None:
        """The forward ended: whatever waits goes now."""
        with self._cond:
            self._forward = False
            self._ended = self._started
            self._cond.notify_all()

    def close(self) -> None:
        """Stop pacing for good (shutdown): waiters go at once, later calls never wait."""
        with self._cond:
            self._closed = True
            self._forward = False
            self._cond.notify_all()

    def wait(self) -> float:
        """Return once the forward running now has ended (or after :attr:`max_hold`
        seconds); the seconds waited (0.0 without a forward: no lock is taken then).

        A waiter goes when *its* forward ends even if the next one has begun by the time it
        runs again: the gap between two forwards can be shorter than a waiting thread takes
        to be scheduled (it needs the GIL), and writes must not starve on a busy engine."""
        if not self._forward:
            return 0.0
        with self._cond:
            if not self._forward:
                return 0.0
            forward = self._started
            start = self.clock()
            deadline = start + self.max_hold
            overran = False
            while self._ended < forward and not self._closed:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    overran = True
                    break
                self._cond.wait(remaining)
            waited = self.clock() - start
            self.counters.holds += 1
            self.counters.held_seconds += waited
            self.counters.overruns += overran
            return waited

    def plan(self) -> "PlanPacing":
        """A new plan's accounting through this gate."""
        return PlanPacing(self)


class PlanPacing:
    """One plan's units of work through a :class:`ForwardPacer`. Each unit runs inside
    :meth:`request`; :attr:`held_seconds` is how long the plan as a whole was held back
    (some unit waiting at the gate, none running). Thread-safe."""

    def __init__(self, pacer: ForwardPacer) -> None:
        self.pacer = pacer
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._since = 0.0
        self._held = 0.0

    @property
    def held_seconds(self) -> float:
        with self._lock:
            held = self._held
            if self._waiting and not self._running:
                held += self.pacer.clock() - self._since
            return held

    @contextmanager
    def request(self) -> Iterator[None]:
        """Wait at the gate, then run the body as one of the plan's running units."""
        if self.pacer.forward_running:
            self._move(waiting=1)
            try:
                self.pacer.wait()
            except BaseException:
                self._move(waiting=-1)
                raise
            self._move(waiting=-1, running=1)
        else:
            self._move(running=1)
        try:
            yield
        finally:
            self._move(running=-1)

    def _move(self, waiting: int = 0, running: int = 0) -> None:
        with self._lock:
            now = self.pacer.clock()
            if self._waiting and not self._running:
                self._held += now - self._since
            self._waiting += waiting
            self._running += running
            self._since = now
