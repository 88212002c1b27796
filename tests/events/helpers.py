"""Shared helpers for the event-plane tests (they live in the package so integration tests and
benchmarks can use them too)."""

from kvstrata.events.testing import chain, random_ops, registry_state

__all__ = ["chain", "random_ops", "registry_state"]
