"""Errors of remote block sharing, each a class a caller can act on.

* :class:`BlockSetError` -- a block set cannot be used, before any byte moves:
  :class:`BlockSetFormatError` (malformed, truncated, oversized, addresses that overflow or
  fall outside the exported regions), :class:`BlockSetVersionError` (another format
  version), :class:`BlockSetMismatchError` (its geometry, dtype or page size differs from
  the importer's: reading it would hand the engine misaligned bytes).
* :class:`LeaseError` -- the exporter refused or lost a lease (unknown or expired lease,
  blocks no longer held, too many leases).
* :class:`RemoteReadError` -- a read failed: the exporter died or disconnected, the read
  timed out, or the bytes did not hash to the exporter's checksum. Nothing read is used.
* :class:`RemoteUnavailableError` -- NIXL is not installed or cannot start here.
"""

from __future__ import annotations

from ..protocol.errors import LayoutFormatError, LayoutMismatchError, LayoutVersionError

__all__ = ["BlockSetError", "BlockSetFormatError", "BlockSetVersionError",
           "BlockSetMismatchError", "LeaseError", "RemoteReadError", "RemoteUnavailableError"]


class BlockSetError(ValueError):
    """A block set cannot be imported (see the subclasses)."""


class BlockSetFormatError(BlockSetError, LayoutFormatError):
    """A serialized block set is malformed or hostile."""


class BlockSetVersionError(BlockSetFormatError, LayoutVersionError):
    """A serialized block set uses a format version this code does not read."""


class BlockSetMismatchError(BlockSetError, LayoutMismatchError):
    """A block set's blocks are laid out differently from the importer's."""


class LeaseError(RuntimeError):
    """The exporter refused a lease, or a lease is unknown or expired."""


class RemoteReadError(RuntimeError):
    """A remote read failed; no byte of it is used."""


class RemoteUnavailableError(RuntimeError):
    """Remote memory needs NIXL, which is missing or cannot start on this machine."""
