"""Typed errors of the storage backends (the layout and transfer errors live in
:mod:`kvstrata.protocol.errors` and are re-exported here).

* :class:`StorageError` -- a backend problem: :class:`StorageConfigError`,
  :class:`StorageClosedError` and :class:`BlockIOError`, which says *which blocks of a batch*
  failed (``failures``). Its subclasses name the cause: :class:`DiskFullError` (ENOSPC),
  :class:`StorageIOError` (EIO and other OS errors, short reads),
  :class:`BlockIntegrityError` (slot empty or holding another block) and its subclasses
  :class:`ChecksumMismatchError` (bytes differ from their recorded xxh3-64) and
  :class:`BlockNotFoundError` (no object under the block's key in a key-addressed tier).

Failed blocks are described by :class:`~kvstrata.protocol.results.BlockFailure` records, which
a worker process can send back to a scheduler process.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..protocol.errors import (EngineBusyError, EngineClosedError, LayoutConfigError,
                               LayoutError, LayoutFormatError, LayoutMismatchError,
                               LayoutVersionError, PhysicalError, TransferError,
                               TransferPlanError)
from ..protocol.results import BlockFailure, FailureKind

__all__ = ["PhysicalError", "LayoutError", "LayoutConfigError", "LayoutMismatchError",
           "LayoutFormatError", "LayoutVersionError", "TransferError", "TransferPlanError",
           "EngineClosedError", "EngineBusyError", "StorageError", "StorageConfigError",
           "StorageClosedError", "SlotPinnedError", "BlockIOError", "DiskFullError", "StorageIOError",
           "BlockIntegrityError", "ChecksumMismatchError", "BlockNotFoundError", "BlockFailure", "FailureKind",
           "raise_for_failures"]


# --------------------------------------------------------------------------- storage
class StorageError(PhysicalError):
    """A storage backend could not be created or used."""


class StorageConfigError(StorageError, ValueError):
    """Invalid storage arguments (e.g. O_DIRECT demanded where the filesystem refuses it)."""


class StorageClosedError(StorageError):
    """The storage was closed; its memory or file is gone."""


class SlotPinnedError(StorageError):
    """A slot is being read by another process (a lease on it is outstanding): it may not be
    overwritten until released."""


class BlockIOError(StorageError):
    """Some blocks of a batch failed; the others completed and are valid.

    ``failures`` lists the failed blocks (position in the batch and block id). For writes,
    ``checksums`` holds, per position, the xxh3-64 of each block written successfully and
    ``None`` for the failed ones, so the caller can register exactly the good blocks.
    """

    def __init__(self, message: str, failures: Sequence[BlockFailure],
                 checksums: Sequence[int | None] | None = None) -> None:
        super().__init__(message)
        self.failures: tuple[BlockFailure, ...] = tuple(failures)
        self.checksums: tuple[int | None, ...] | None = (
            None if checksums is None else tuple(checksums))

    @property
    def failed_positions(self) -> tuple[int, ...]:
        """Positions (in the batch) of the failed blocks."""
        return tuple(f.position for f in self.failures)

    @property
    def failed_block_ids(self) -> tuple[int, ...]:
        """Block ids (in the failing storage) of the failed blocks."""
        return tuple(f.block_id for f in self.failures)


class DiskFullError(BlockIOError):
    """The filesystem ran out of space (ENOSPC/EDQUOT) while writing or preallocating."""


class StorageIOError(BlockIOError):
    """An I/O error (EIO, short read/write, any other OS error) on some blocks."""


class BlockIntegrityError(BlockIOError):
    """A slot holds no valid block, or holds a different block than the one asked for."""


class ChecksumMismatchError(BlockIntegrityError):
    """The bytes read back differ from the checksum recorded when they were written."""


class BlockNotFoundError(BlockIntegrityError):
    """No object is stored under the block's key (a key-addressed tier such as G4)."""


_ERROR_BY_KIND: dict[FailureKind, type[BlockIOError]] = {
    FailureKind.DISK_FULL: DiskFullError,
    FailureKind.IO_ERROR: StorageIOError,
    FailureKind.INTERNAL: StorageIOError,
    FailureKind.CHECKSUM_MISMATCH: ChecksumMismatchError,
    FailureKind.NOT_WRITTEN: BlockIntegrityError,
    FailureKind.HASH_MISMATCH: BlockIntegrityError,
    FailureKind.NOT_FOUND: BlockNotFoundError,
}
_SEVERITY = [FailureKind.DISK_FULL, FailureKind.IO_ERROR, FailureKind.INTERNAL,
             FailureKind.CHECKSUM_MISMATCH, FailureKind.HASH_MISMATCH, FailureKind.NOT_WRITTEN,
             FailureKind.NOT_FOUND]


def raise_for_failures(operation: str, failures: Iterable[BlockFailure], batch_size: int,
                       checksums: Sequence[int | None] | None = None) -> None:
    """Raise the :class:`BlockIOError` subclass matching the most severe failure, if any."""
    failures = sorted(failures, key=lambda f: f.position)
    if not failures:
        return
    worst = min(failures, key=lambda f: _SEVERITY.index(f.kind))
    cls = _ERROR_BY_KIND[worst.kind]
    raise cls(f"{operation}: {len(failures)} of {batch_size} blocks failed; first: block "
              f"{failures[0].block_id} ({failures[0].kind.value}: {failures[0].detail})",
              failures, checksums)
