"""Shared helpers for the event-plane tests (they live in the package so integration tests and
benchmarks can use them too)."""

import threading

from kvstrata.events.testing import chain, random_ops, registry_state

__all__ = ["CountingCondition", "chain", "random_ops", "registry_state"]


class CountingCondition(threading.Condition):
    """A publisher's condition that counts the wake-ups its hooks ask for."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)
