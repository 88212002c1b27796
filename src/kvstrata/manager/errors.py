"""The errors ``KvBlockManager`` raises (all are :class:`ManagerError`)."""

from __future__ import annotations

__all__ = ["ManagerError", "ManagerClosedError", "ManagerConfigError", "InvalidBlockError"]


class ManagerError(RuntimeError):
    """Base class of block manager errors."""


class ManagerClosedError(ManagerError):
    """The manager was closed; it accepts no more calls."""


class ManagerConfigError(ManagerError, ValueError):
    """The configuration cannot be turned into tiers (a tier kind without a storage backend,
    a size over a limit, KV tensors that do not match the config, a metrics port that cannot
    be bound)."""


class InvalidBlockError(ManagerError, ValueError):
    """A call named blocks it may not use: a block id out of range, a block not held or
    already registered, a payload of the wrong size, a block identity (hash, block size) that
    cannot be stored. Raised before anything changed."""
