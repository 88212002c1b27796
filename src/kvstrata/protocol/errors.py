"""Errors about blocks' bytes and their descriptions, importable without torch.

Every error a caller can act on has its own class, rooted at :class:`PhysicalError` (the
storage errors of :mod:`kvstrata.physical.errors` share the root):

* :class:`LayoutError` -- a geometry problem: :class:`LayoutConfigError` (invalid numbers),
  :class:`LayoutMismatchError` (two layouts that cannot exchange blocks),
  :class:`LayoutFormatError` (malformed serialized layout), :class:`LayoutVersionError`
  (a serialized layout from an unsupported format version).
* :class:`TransferError` -- :class:`TransferPlanError` (a malformed plan or result, or one
  out of range), :class:`EngineClosedError`, :class:`EngineBusyError` (bounded queue full).
"""

from __future__ import annotations

__all__ = ["PhysicalError", "LayoutError", "LayoutConfigError", "LayoutMismatchError",
           "LayoutFormatError", "LayoutVersionError", "TransferError", "TransferPlanError",
           "EngineClosedError", "EngineBusyError"]


class PhysicalError(Exception):
    """Root of every error about block bytes: layouts, plans, storages, transfers."""


# --------------------------------------------------------------------------- layouts
class LayoutError(PhysicalError, ValueError):
    """A layout is invalid, incompatible or cannot be decoded."""


class LayoutConfigError(LayoutError):
    """A :class:`~kvstrata.protocol.layout.LayoutConfig` field is out of range."""


class LayoutMismatchError(LayoutError):
    """Two layouts differ in geometry or dtype, so blocks cannot be copied between them."""


class LayoutFormatError(LayoutError):
    """A serialized layout is malformed (missing/unknown keys, wrong types, bad sizes)."""


class LayoutVersionError(LayoutFormatError):
    """A serialized layout uses a format version this code does not understand."""


# --------------------------------------------------------------------------- transfers
class TransferError(PhysicalError):
    """A transfer could not be submitted."""


class TransferPlanError(TransferError, ValueError):
    """A :class:`~kvstrata.protocol.plans.TransferPlan` (or a result for one) is malformed,
    names an unknown tier or endpoint, or is out of range."""


class EngineClosedError(TransferError):
    """The transfer engine was closed."""


class EngineBusyError(TransferError):
    """The path's bounded queue stayed full for the whole submit timeout."""
