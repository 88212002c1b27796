"""The errors ``KvBlockManager`` raises (all are :class:`ManagerError`)."""

from __future__ import annotations

from ..config import ConfigError

__all__ = ["ManagerError", "ManagerClosedError", "ManagerConfigError", "InvalidConfigError",
           "InvalidBlockError"]


class ManagerError(RuntimeError):
    """Base class of block manager errors."""


class ManagerClosedError(ManagerError):
    """The manager was closed; it accepts no more calls."""


class ManagerConfigError(ManagerError, ValueError):
    """The configuration cannot be turned into tiers (a tier kind without a storage backend,
    a size over a limit, KV tensors that do not match the config, a metrics port that cannot
    be bound)."""


class InvalidConfigError(ManagerConfigError, ConfigError):
    """The :class:`~kvstrata.config.KvConfig` given is itself invalid: a
    :class:`ManagerConfigError` and a :class:`~kvstrata.config.ConfigError` (with its
    ``problems``), so either catches it."""

    def __init__(self, problems: list[str]) -> None:
        ConfigError.__init__(self, problems)
        Exception.__init__(self, "; ".join(self.problems))


class InvalidBlockError(ManagerError, ValueError):
    """A call named blocks it may not use: a block id out of range, a block not held or
    already registered, a payload of the wrong size, a block identity (hash, block size) that
    cannot be stored. Raised before anything changed."""
